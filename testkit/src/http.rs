//! A minimal HTTP/1.0 GET: the agents' pages are read the way a scraper reads them, without a
//! client library's retries or connection reuse in the way.

use std::fmt::Display;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The status code and body of `GET path` from `addr` (connect within 2 s, read within 10 s),
/// or None when it could not be read.
pub fn get_status<A: ToSocketAddrs + Display>(addr: A, path: &str) -> Option<(u16, String)> {
    let to = addr.to_socket_addrs().ok()?.next()?;
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// The body of `GET path` when the answer is 200.
pub fn get<A: ToSocketAddrs + Display>(addr: A, path: &str) -> Option<String> {
    match get_status(addr, path)? {
        (200, body) => Some(body),
        _ => None,
    }
}

/// `q` as a URL query value: every byte but ASCII letters and digits percent-encoded.
pub fn query_encode(q: &str) -> String {
    q.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            super::query_encode("rate(x{a=\"b\"}[1m])"),
            "rate%28x%7Ba%3D%22b%22%7D%5B1m%5D%29"
        );
    }

    use super::*;
    use std::net::TcpListener;

    #[test]
    fn reads_status_and_body() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            for answer in ["200 OK", "404 Not Found"] {
                let (mut c, _) = l.accept().unwrap();
                // the whole request, or closing with unread bytes would reset the connection
                let mut req = Vec::new();
                let mut b = [0u8; 256];
                while !req.ends_with(b"\r\n\r\n") {
                    let n = c.read(&mut b).unwrap();
                    assert!(n > 0, "request cut short: {req:?}");
                    req.extend_from_slice(&b[..n]);
                }
                assert!(req.starts_with(b"GET /metrics HTTP/1.0\r\n"));
                write!(
                    c,
                    "HTTP/1.0 {answer}\r\nContent-Type: text/plain\r\n\r\nbody\n"
                )
                .unwrap();
            }
        });
        assert_eq!(get(addr, "/metrics").as_deref(), Some("body\n"));
        assert_eq!(get_status(addr, "/metrics"), Some((404, "body\n".into())));
        server.join().unwrap();
    }

    #[test]
    fn nothing_listening_is_none() {
        let port = crate::free_port();
        assert_eq!(get(format!("127.0.0.1:{port}"), "/"), None);
    }
}
