//! An incremental `text/event-stream` parser. It sees a copy of each response chunk as it
//! passes (the chunks themselves are not held) and yields the `data` of each complete
//! event. Handles lines split across chunks, multi-line data, CRLF / CR / LF line ends,
//! comments, a leading BOM, and fields it does not use (`event`, `retry`). It keeps the
//! stream's last event id the way a browser's `EventSource` does (the `id` of the last
//! finished event, kept until another one sets it), which is what a client sends back as
//! `Last-Event-ID` when it resumes the stream.

/// The pending event grew past the limit; the parser stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge;

/// Parser state between chunks.
#[derive(Debug, Clone)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    after_cr: bool,
    first_line: bool,
    max_event_bytes: usize,
    dead: bool,
    id_buffer: Option<String>,
    last_event_id: Option<String>,
}

impl SseParser {
    /// `max_event_bytes` bounds the memory one pending event (its data plus the current
    /// line) may take.
    pub fn new(max_event_bytes: usize) -> SseParser {
        SseParser {
            line: Vec::new(),
            data: Vec::new(),
            has_data: false,
            after_cr: false,
            first_line: true,
            max_event_bytes,
            dead: false,
            id_buffer: None,
            last_event_id: None,
        }
    }

    /// The last event id of the stream so far (set when an event carrying `id` ends).
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_event_id.as_deref()
    }

    /// Feeds one chunk; the data of every event completed by it is appended to `events`.
    /// Data that is not UTF-8 is skipped (it cannot be a JSON-RPC message).
    pub fn feed(&mut self, chunk: &[u8], events: &mut Vec<String>) -> Result<(), TooLarge> {
        if self.dead {
            return Err(TooLarge);
        }
        for &b in chunk {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\r' => {
                    self.after_cr = true;
                    self.end_line(events);
                }
                b'\n' => self.end_line(events),
                _ => {
                    self.line.push(b);
                    if self.line.len() + self.data.len() > self.max_event_bytes {
                        self.dead = true;
                        self.line = Vec::new();
                        self.data = Vec::new();
                        return Err(TooLarge);
                    }
                }
            }
        }
        Ok(())
    }

    fn end_line(&mut self, events: &mut Vec<String>) {
        let mut line = std::mem::take(&mut self.line);
        if self.first_line {
            self.first_line = false;
            if line.starts_with(&[0xef, 0xbb, 0xbf]) {
                line.drain(..3);
            }
        }
        if line.is_empty() {
            if self.id_buffer.is_some() {
                self.last_event_id.clone_from(&self.id_buffer);
            }
            if self.has_data {
                let mut data = std::mem::take(&mut self.data);
                if data.last() == Some(&b'\n') {
                    data.pop();
                }
                if let Ok(s) = String::from_utf8(data) {
                    events.push(s);
                }
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (&line[..], &[][..]),
        };
        if field == b"data" {
            self.data.extend_from_slice(value);
            self.data.push(b'\n');
            self.has_data = true;
        } else if field == b"id" && !value.contains(&0) {
            if let Ok(id) = std::str::from_utf8(value) {
                self.id_buffer = Some(id.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\u{feff}: keep-alive comment\r\n\
        event: message\r\n\
        id: 1\r\n\
        data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\r\n\
        data: \"params\":{\"progress\":1}}\r\n\
        \r\n\
        retry: 1000\n\
        data:{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"x\":\"a:b\"}}\n\
        \n\
        data\n\
        \n\
        data: tail\rdata: more\r\r\
        data: never finished";

    fn expected() -> Vec<String> {
        vec![
            "{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\n\"params\":{\"progress\":1}}".into(),
            "{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"x\":\"a:b\"}}".into(),
            String::new(),
            "tail\nmore".into(),
        ]
    }

    #[test]
    fn whole_stream() {
        let mut p = SseParser::new(1 << 20);
        let mut out = Vec::new();
        assert_eq!(p.feed(SAMPLE.as_bytes(), &mut out), Ok(()));
        assert_eq!(out, expected());
    }

    #[test]
    fn split_at_every_byte_position() {
        let bytes = SAMPLE.as_bytes();
        for i in 0..=bytes.len() {
            let mut p = SseParser::new(1 << 20);
            let mut out = Vec::new();
            assert_eq!(p.feed(&bytes[..i], &mut out), Ok(()));
            assert_eq!(p.feed(&bytes[i..], &mut out), Ok(()));
            assert_eq!(out, expected(), "split at {i}");
        }
        for j in [1usize, 2, 3, 5, 7] {
            let mut p = SseParser::new(1 << 20);
            let mut out = Vec::new();
            for c in bytes.chunks(j) {
                assert_eq!(p.feed(c, &mut out), Ok(()));
            }
            assert_eq!(out, expected(), "chunks of {j}");
        }
    }

    #[test]
    fn last_event_id_follows_finished_events() {
        let mut p = SseParser::new(1 << 20);
        let mut out = Vec::new();
        assert_eq!(p.feed(b"data: a\n\n", &mut out), Ok(()));
        assert_eq!(p.last_event_id(), None);
        // A priming event: id and empty data.
        assert_eq!(p.feed(b"id: ev-1\ndata:\n\n", &mut out), Ok(()));
        assert_eq!(p.last_event_id(), Some("ev-1"));
        // Unfinished: not yet.
        assert_eq!(p.feed(b"id: ev-2\ndata: b\n", &mut out), Ok(()));
        assert_eq!(p.last_event_id(), Some("ev-1"));
        assert_eq!(p.feed(b"\n", &mut out), Ok(()));
        assert_eq!(p.last_event_id(), Some("ev-2"));
        // An event without id keeps the last one.
        assert_eq!(p.feed(b"data: c\n\n", &mut out), Ok(()));
        assert_eq!(p.last_event_id(), Some("ev-2"));
        let mut q = SseParser::new(1 << 20);
        assert_eq!(q.feed(SAMPLE.as_bytes(), &mut out), Ok(()));
        assert_eq!(q.last_event_id(), Some("1"));
    }

    #[test]
    fn oversized_event_stops_the_parser() {
        let mut p = SseParser::new(16);
        let mut out = Vec::new();
        assert_eq!(p.feed(b"data: 0123456789\n", &mut out), Ok(()));
        assert_eq!(p.feed(b"data: 0123456789\n\n", &mut out), Err(TooLarge));
        assert_eq!(p.feed(b"data: x\n\n", &mut out), Err(TooLarge));
        assert!(out.is_empty());
        // Small events one after another never trip it.
        let mut p = SseParser::new(16);
        for _ in 0..100 {
            assert_eq!(p.feed(b"data: 0123456\n\n", &mut out), Ok(()));
        }
        assert_eq!(out.len(), 100);
    }
}
