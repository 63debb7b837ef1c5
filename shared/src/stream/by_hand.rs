//! The host's end of the stream written by hand, for the agents' tests that then speak frames
//! the client driver would never send (hostile, out of order, unknown kinds). Behind the
//! `samples` feature: no release build carries it.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::proto::{encode, ClientSession, FrameDecoder, Message, Welcome};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// A QUIC client endpoint on an ephemeral loopback port, and the client configuration made
/// from `tls` (`tls::client_config`).
pub fn client_endpoint(
    tls: rustls::ClientConfig,
) -> Result<(quinn::Endpoint, quinn::ClientConfig), Error> {
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let ep = quinn::Endpoint::client((std::net::Ipv4Addr::LOCALHOST, 0).into())?;
    Ok((ep, quinn::ClientConfig::new(Arc::new(quic))))
}

/// A connection to the hub at `addr` whose handshake is done: the control stream opened, the
/// Hello of `host` (boot `boot`) sent and the hub's Welcome read. Both halves of the control
/// stream are returned: dropping the receive half would stop the hub's acks and probes, which
/// ends the connection.
pub async fn hello(
    tls: rustls::ClientConfig,
    addr: SocketAddr,
    host: &str,
    boot: u64,
) -> Result<
    (
        quinn::Connection,
        quinn::SendStream,
        quinn::RecvStream,
        Welcome,
    ),
    Error,
> {
    let (ep, cc) = client_endpoint(tls)?;
    let conn = ep.connect_with(cc, addr, "127.0.0.1")?.await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let mut hello = Vec::new();
    encode(&ClientSession::new(host, boot).hello(), &mut hello)?;
    send.write_all(&hello).await?;
    let mut frames = FrameDecoder::default();
    loop {
        match frames.next_frame()? {
            Some(Message::Welcome(w)) => return Ok((conn, send, recv, w)),
            Some(Message::WelcomeVm(w)) => return Ok((conn, send, recv, w.welcome)),
            _ => {}
        }
        let chunk = recv
            .read_chunk(1 << 16, true)
            .await?
            .ok_or("the hub closed the control stream before its Welcome")?;
        frames.push(&chunk.bytes);
    }
}
