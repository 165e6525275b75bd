//! The unread rest of a request's body, read and dropped before the answer goes out.
//!
//! A route may answer before it reads the body: a bad token (401), a missing permission (403), an
//! unsupported content type (415), a bad name in the query (422). The server then closes the
//! connection after the answer, with the body unread. A client that keeps connections alive
//! sends its next request on that one and gets "error sending request" instead of an answer:
//! the e2e test `web` saw it once, on the LoRA upload after a 415 (the unit test below
//! reproduces it every time); a client still sending when the socket closes can get a reset
//! before the answer. So every request's body is read to its end after the route is done with it,
//! up to [`DRAIN_BYTES`] and [`DRAIN_TIME`], and dropped, and the connection stays usable; a
//! larger rest is left and the connection closed as before. Go's `net/http` server does the same
//! after every handler (256 KiB there); the design is learned from it (BSD-3-Clause), no code
//! taken.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use axum::extract::Request;
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use tokio::sync::Mutex;

/// At most this much of an unread body is read after the route answered.
pub const DRAIN_BYTES: usize = 4 << 20;
/// At most this long is spent reading it.
pub const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Middleware: the route gets the body through a handle; once it answered, what it left unread is
/// read and dropped (bounded) before the answer is sent.
pub async fn drain_unread(request: Request, next: Next) -> Response {
    // A client that asked to be told before it sends (`Expect: 100-continue`, curl's way with
    // large files) sent nothing the route did not ask for: reading would only ask it to send.
    let waits_to_send = request
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if waits_to_send {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let shared = Arc::new(Mutex::new(body.into_data_stream()));
    let handed = Body::from_stream(futures::stream::unfold(
        shared.clone(),
        |stream| async move {
            let item = stream.lock().await.next().await;
            item.map(|item| (item, stream))
        },
    ));
    let response = next.run(Request::from_parts(parts, handed)).await;
    let _ = tokio::time::timeout(DRAIN_TIME, drop_rest(&shared)).await;
    response
}

async fn drop_rest(stream: &Mutex<BodyDataStream>) {
    let mut stream = stream.lock().await;
    let mut read = 0;
    while let Some(Ok(chunk)) = stream.next().await {
        read += chunk.len();
        if read > DRAIN_BYTES {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A route that refuses at once, without reading the body.
    async fn refuse() -> StatusCode {
        StatusCode::UNPROCESSABLE_ENTITY
    }

    /// Posts `bytes` of body twice over one kept-alive connection, as a client's pool does; the
    /// two status lines, or why they did not come.
    async fn send(addr: std::net::SocketAddr, bytes: usize) -> Result<Vec<String>, std::io::Error> {
        let mut socket = tokio::net::TcpStream::connect(addr).await?;
        let mut statuses = Vec::new();
        for _ in 0..2 {
            let head = format!(
                "POST /refuse HTTP/1.1\r\nhost: test\r\n\
                 content-type: application/octet-stream\r\ncontent-length: {bytes}\r\n\r\n"
            );
            socket.write_all(head.as_bytes()).await?;
            socket.write_all(&vec![7u8; bytes]).await?;
            statuses.push(read_answer(&mut socket).await?);
        }
        Ok(statuses)
    }

    /// One answer's status line; its headers and (empty or sized) body are read past.
    async fn read_answer(socket: &mut tokio::net::TcpStream) -> Result<String, std::io::Error> {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if socket.read(&mut byte).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).to_string();
        let length = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0usize);
        let mut body = vec![0u8; length];
        socket.read_exact(&mut body).await?;
        Ok(head.lines().next().unwrap_or_default().to_owned())
    }

    /// A server of the refusing route behind the middleware, on a free port.
    async fn refusing_server() -> std::net::SocketAddr {
        let app = Router::new()
            .route("/refuse", post(refuse))
            .layer(axum::middleware::from_fn(drain_unread));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    /// 20 clients each send 1 MiB twice over one connection to a route that refuses at once: each
    /// gets both refusals. Without the middleware the server closed every connection after the
    /// first refusal and every second send failed (measured: 20 of 20, broken pipe).
    #[tokio::test]
    async fn a_refusal_before_the_body_reaches_the_client_sending_it() {
        let addr = refusing_server().await;
        for i in 0..20 {
            let status = send(addr, 1 << 20).await;
            assert!(
                status
                    .as_ref()
                    .is_ok_and(|s| s.iter().all(|s| s.starts_with("HTTP/1.1 422"))),
                "client {i}: {status:?}"
            );
        }
    }

    /// A client that waits for `100 Continue` before it sends is answered at once, without being
    /// asked to send a body the route refused.
    #[tokio::test]
    async fn a_client_that_waits_to_send_is_refused_without_being_asked_to_send() {
        let addr = refusing_server().await;
        let mut socket = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = "POST /refuse HTTP/1.1\r\nhost: test\r\nexpect: 100-continue\r\n\
                    content-type: application/octet-stream\r\ncontent-length: 1048576\r\n\r\n";
        socket.write_all(head.as_bytes()).await.expect("head");
        let status = tokio::time::timeout(Duration::from_secs(1), read_answer(&mut socket))
            .await
            .expect("an answer within a second")
            .expect("an answer");
        assert!(status.starts_with("HTTP/1.1 422"), "{status}");
    }
}
