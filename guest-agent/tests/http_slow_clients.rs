//! The guest's HTTP server listens on the node address, which every pod can reach: 5,000
//! connections that send half a request and stall must not grow the process by more than
//! 40 MB, must not keep a normal scrape from answering, and must be closed after the header
//! read timeout. The server runs in this test process (the RSS covers the clients' side too).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const SLOW: usize = 5_000;

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

async fn slow_client(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(from.parse().unwrap())?;
    let mut s = sock.connect(to).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: node\r\nUser-Agent: slo")
        .await?;
    Ok(s)
}

async fn scrape(to: SocketAddr) -> String {
    let mut s = TcpStream::connect(to).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_cost_bounded_memory_and_a_scrape_still_answers() {
    let reg = prometheus::Registry::new();
    let g = prometheus::IntGauge::new("slow_clients_test_gauge", "a value to scrape").unwrap();
    g.set(42);
    reg.register(Box::new(g)).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gpufeed_guest::exporter::serve(
        listener,
        reg,
        Arc::new(|| true),
        axum::Router::new(),
    ));
    assert!(scrape(addr).await.contains("slow_clients_test_gauge 42"));
    let base = rss_bytes();

    let mut held = Vec::with_capacity(SLOW);
    for _ in 0..SLOW {
        // A connection the server closes at once is fine: the point is what it keeps.
        if let Ok(s) = slow_client("127.0.0.2:0", addr).await {
            held.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    let body = tokio::time::timeout(Duration::from_secs(5), scrape(addr))
        .await
        .expect("scrape answered while slow clients are held");
    let scrape_time = t0.elapsed();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("slow_clients_test_gauge 42"));
    let grown = rss_bytes().saturating_sub(base);
    eprintln!(
        "{} slow connections held: RSS grew {} KiB, scrape took {scrape_time:?}",
        held.len(),
        grown >> 10
    );
    assert!(grown < 40 << 20, "RSS grew {} MiB", grown >> 20);

    // Every slow connection is closed by the server within the header read timeout (5 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut open = 0;
    for s in &mut held {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut b = [0u8; 512];
        match tokio::time::timeout(left, s.read(&mut b)).await {
            Ok(_) => {}
            Err(_) => open += 1,
        }
    }
    assert_eq!(open, 0, "slow connections still open after 10 s");
}
