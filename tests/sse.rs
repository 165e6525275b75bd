//! The scheduler's Server-Sent Events as the tests read them, decoded by `sse-stream` (the command
//! line's decoder too), which keeps an unfinished line or UTF-8 character until the next chunk
//! completes it.

use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use serde_json::Value;
use sse_stream::{Sse, SseByteStream};

/// The events of a body (`reqwest::Response::bytes_stream`), in order; blocks without data (the
/// keep-alive comments) are no events.
pub fn events<E>(
    body: impl Stream<Item = Result<Bytes, E>>,
) -> impl Stream<Item = anyhow::Result<Sse>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    SseByteStream::new(body)
        .map_err(anyhow::Error::from)
        .try_filter(|event| std::future::ready(event.data.is_some()))
}

/// The JSON of each event's data.
pub fn json<E>(
    body: impl Stream<Item = Result<Bytes, E>>,
) -> impl Stream<Item = anyhow::Result<Value>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    events(body).map(|event| {
        let data = event?.data.unwrap_or_default();
        Ok(serde_json::from_str(&data)?)
    })
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;

    #[tokio::test]
    async fn a_character_split_across_chunks_arrives_whole() -> anyhow::Result<()> {
        let stream = ": keep-alive\n\nid: 7\nevent: completed\ndata: {\"prompt\":\"é 中 🙂\"}\n\n";
        let want = serde_json::json!({"prompt": "é 中 🙂"});
        // Every cut point, among them each byte inside the two-, three- and four-byte characters.
        for cut in 0..=stream.len() {
            let (head, tail) = stream.as_bytes().split_at(cut);
            let chunks = [head, tail].map(|c| Ok::<_, Infallible>(Bytes::copy_from_slice(c)));
            let got: Vec<Value> = json(futures::stream::iter(chunks)).try_collect().await?;
            assert_eq!(got, std::slice::from_ref(&want), "cut at byte {cut}");
        }
        let sse = events(futures::stream::iter(
            stream
                .bytes()
                .map(|b| Ok::<_, Infallible>(Bytes::copy_from_slice(&[b]))),
        ))
        .try_collect::<Vec<Sse>>()
        .await?;
        assert_eq!(sse.len(), 1, "one event, byte by byte: {sse:?}");
        assert_eq!(
            (sse[0].id.as_deref(), sse[0].event.as_deref()),
            (Some("7"), Some("completed"))
        );
        Ok(())
    }
}
