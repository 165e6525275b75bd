//! An incremental Server-Sent Events parser: bytes in, complete events out.
//!
//! It keeps the unfinished tail of the byte stream between calls, so a line (or a UTF-8 character)
//! split across two network chunks is parsed once it is whole. Only what the scheduler sends is
//! interpreted: `id:`, `event:`, `data:` (lines joined by `\n`) and `:` comments; `retry:` and unknown
//! fields are ignored, as the SSE specification requires.

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The last event id seen on the stream up to and including this event (what `Last-Event-ID` resumes from).
    pub id: Option<String>,
    /// The `event:` field; `message` when absent.
    pub event: String,
    pub data: String,
}

#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes after the last complete line.
    tail: Vec<u8>,
    /// Persists across events, as in the specification.
    last_id: Option<String>,
    event: Option<String>,
    data: Option<String>,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes a chunk of the stream and returns the events it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.tail.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(pos) = self.tail[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos;
            let raw = &self.tail[start..end];
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            let line = String::from_utf8_lossy(raw).into_owned();
            start = end + 1;
            if let Some(event) = self.line(&line) {
                events.push(event);
            }
        }
        self.tail.drain(..start);
        events
    }

    fn line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            let event = self.event.take();
            let data = self.data.take()?;
            return Some(SseEvent {
                id: self.last_id.clone(),
                event: event.unwrap_or_else(|| "message".to_owned()),
                data,
            });
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            "event" => self.event = Some(value.to_owned()),
            "id" if !value.contains('\0') => self.last_id = Some(value.to_owned()),
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: Option<&str>, event: &str, data: &str) -> SseEvent {
        SseEvent {
            id: id.map(str::to_owned),
            event: event.to_owned(),
            data: data.to_owned(),
        }
    }

    #[test]
    fn parses_events_and_skips_comments() {
        let mut p = SseParser::new();
        let got = p.feed(b":keep-alive\n\nid: 7\nevent: queued\ndata: {\"seq\":7}\n\nid:8\nevent:progress\ndata:{}\n\n");
        assert_eq!(
            got,
            vec![
                event(Some("7"), "queued", "{\"seq\":7}"),
                event(Some("8"), "progress", "{}")
            ]
        );
    }

    #[test]
    fn joins_multi_line_data() {
        let mut p = SseParser::new();
        let got = p.feed(b"data: first\ndata:second\ndata\ndata:  indented\n\n");
        assert_eq!(
            got,
            vec![event(None, "message", "first\nsecond\n\n indented")]
        );
    }

    #[test]
    fn handles_partial_chunks_and_crlf() {
        let stream = "id: 41\r\nevent: completed\r\ndata: {\"outputs\":[\"é\"]}\r\n\r\n: ping\r\n\r\nid: 42\r\ndata: x\r\n\r\n";
        let whole = SseParser::new().feed(stream.as_bytes());
        assert_eq!(whole.len(), 2);
        // Every split point, including ones inside the two-byte 'é' and between '\r' and '\n'.
        for cut in 0..stream.len() {
            let mut p = SseParser::new();
            let mut got = p.feed(&stream.as_bytes()[..cut]);
            got.extend(p.feed(&stream.as_bytes()[cut..]));
            assert_eq!(got, whole, "split at {cut}");
        }
        // Byte by byte.
        let mut p = SseParser::new();
        let got: Vec<_> = stream
            .as_bytes()
            .iter()
            .flat_map(|b| p.feed(&[*b]))
            .collect();
        assert_eq!(got, whole);
        assert_eq!(
            got[0],
            event(Some("41"), "completed", "{\"outputs\":[\"é\"]}")
        );
        assert_eq!(got[1], event(Some("42"), "message", "x"));
    }

    #[test]
    fn events_without_data_are_not_dispatched_and_the_id_persists() {
        let mut p = SseParser::new();
        assert!(p.feed(b"id: 3\nevent: noise\n\n").is_empty());
        assert_eq!(
            p.feed(b"data: y\n\n"),
            vec![event(Some("3"), "message", "y")]
        );
        // An unterminated event is held back until its blank line.
        assert!(p.feed(b"data: z\n").is_empty());
        assert_eq!(p.feed(b"\n"), vec![event(Some("3"), "message", "z")]);
    }
}
