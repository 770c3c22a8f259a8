//! An incremental `text/event-stream` parser. It sees a copy of each response chunk as it
//! passes (the chunks themselves are not held) and yields the `data` of each complete
//! event. Handles lines split across chunks, multi-line data, CRLF / CR / LF line ends,
//! comments, a leading BOM, and fields it does not use (`event`, `retry`). It keeps the
//! stream's last event id the way a browser's `EventSource` does (the `id` of the last
//! finished event, kept until another one sets it), which is what a client sends back as
//! `Last-Event-ID` when it resumes the stream.
//!
//! It also knows where each event sits in the stream (byte offsets counted from the first
//! byte fed), and where its unfinished event began, so the filter can hold back a partial
//! event and edit the JSON text of a complete one in place.

/// The pending event grew past the limit; the parser stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge;

/// One complete event with data, and where it sits in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event's data: its data lines' values joined by LF.
    pub data: String,
    /// Stream offset of the event's first byte.
    pub start: u64,
    /// Stream offset one past the line end of the blank line that ended it.
    pub end: u64,
    /// Each data line's value: stream offset and length.
    lines: Vec<(u64, usize)>,
}

impl Event {
    /// The stream offset of byte `i` of [`Event::data`] (`i` up to its length). A byte of
    /// `data` is a byte of a data line's value, or the LF joining two lines, which stands
    /// for the end of the earlier line.
    pub fn stream_offset(&self, i: usize) -> Option<u64> {
        let mut from = 0usize;
        for &(at, len) in &self.lines {
            if i <= from + len {
                return Some(at + (i - from) as u64);
            }
            from += len + 1;
        }
        None
    }
}

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
    /// Stream offset of the next byte.
    pos: u64,
    /// Stream offset where the current line began.
    line_start: u64,
    /// Stream offset where the current event began.
    event_start: u64,
    /// The current event's data lines (see [`Event`]).
    data_lines: Vec<(u64, usize)>,
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
            pos: 0,
            line_start: 0,
            event_start: 0,
            data_lines: Vec::new(),
        }
    }

    /// Where the unfinished event began, when bytes of one have been fed (a partial line or
    /// lines without their blank line yet); `None` between events or once the parser
    /// stopped.
    pub fn pending_start(&self) -> Option<u64> {
        (!self.dead && self.pos > self.event_start).then_some(self.event_start)
    }

    /// The limit one pending event may take.
    pub fn max_event_bytes(&self) -> usize {
        self.max_event_bytes
    }

    /// How many bytes were fed.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// The last event id of the stream so far (set when an event carrying `id` ends).
    pub fn last_event_id(&self) -> Option<&str> {
        self.last_event_id.as_deref()
    }

    /// Feeds one chunk; the data of every event completed by it is appended to `events`.
    /// Data that is not UTF-8 is skipped (it cannot be a JSON-RPC message).
    pub fn feed(&mut self, chunk: &[u8], events: &mut Vec<String>) -> Result<(), TooLarge> {
        let mut found = Vec::new();
        let res = self.feed_events(chunk, &mut found);
        events.extend(found.into_iter().map(|e| e.data));
        res
    }

    /// [`SseParser::feed`], with where each event sits in the stream.
    pub fn feed_events(&mut self, chunk: &[u8], events: &mut Vec<Event>) -> Result<(), TooLarge> {
        if self.dead {
            return Err(TooLarge);
        }
        for &b in chunk {
            let at = self.pos;
            self.pos += 1;
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    // The LF of a CRLF belongs to the line (and event) the CR ended.
                    if self.line_start == at {
                        self.line_start = self.pos;
                    }
                    if self.event_start == at {
                        self.event_start = self.pos;
                    }
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
                        self.data_lines = Vec::new();
                        return Err(TooLarge);
                    }
                }
            }
        }
        Ok(())
    }

    fn end_line(&mut self, events: &mut Vec<Event>) {
        let mut line = std::mem::take(&mut self.line);
        let mut line_at = self.line_start;
        self.line_start = self.pos;
        if self.first_line {
            self.first_line = false;
            if line.starts_with(&[0xef, 0xbb, 0xbf]) {
                line.drain(..3);
                line_at += 3;
            }
        }
        if line.is_empty() {
            if self.id_buffer.is_some() {
                self.last_event_id.clone_from(&self.id_buffer);
            }
            let start = self.event_start;
            self.event_start = self.pos;
            let lines = std::mem::take(&mut self.data_lines);
            if self.has_data {
                let mut data = std::mem::take(&mut self.data);
                if data.last() == Some(&b'\n') {
                    data.pop();
                }
                if let Ok(data) = String::from_utf8(data) {
                    events.push(Event {
                        data,
                        start,
                        end: self.pos,
                        lines,
                    });
                }
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value, value_at) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                match v.strip_prefix(b" ") {
                    Some(rest) => (&line[..i], rest, i + 2),
                    None => (&line[..i], v, i + 1),
                }
            }
            None => (&line[..], &[][..], line.len()),
        };
        if field == b"data" {
            self.data.extend_from_slice(value);
            self.data.push(b'\n');
            self.has_data = true;
            self.data_lines
                .push((line_at + value_at as u64, value.len()));
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

    /// The stream cut into chunks of `n` bytes, its events as found, with `stream` to read
    /// each event's text back at the offsets the events give.
    fn events_of(stream: &[u8], n: usize) -> Vec<Event> {
        let mut p = SseParser::new(1 << 20);
        let mut out = Vec::new();
        for c in stream.chunks(n.max(1)) {
            assert_eq!(p.feed_events(c, &mut out), Ok(()));
        }
        out
    }

    #[test]
    fn events_know_where_they_and_their_data_sit() {
        let bytes = SAMPLE.as_bytes();
        for n in [1usize, 2, 3, 7, bytes.len()] {
            let events = events_of(bytes, n);
            let data: Vec<&str> = events.iter().map(|e| e.data.as_str()).collect();
            assert_eq!(data, expected(), "chunks of {n}");
            for e in &events {
                // Every byte of the data is at its offset in the stream; a joining LF stands
                // at the end of the earlier line.
                for (i, b) in e.data.bytes().enumerate() {
                    let at = e.stream_offset(i).and_then(|o| usize::try_from(o).ok());
                    let raw = at.and_then(|o| bytes.get(o)).copied();
                    if b == b'\n' {
                        assert!(matches!(raw, Some(b'\r' | b'\n')), "{e:?} {i}");
                    } else {
                        assert_eq!(raw, Some(b), "{e:?} byte {i}");
                    }
                }
                assert!(e.stream_offset(e.data.len()).is_some());
                assert_eq!(e.stream_offset(e.data.len() + 2), None);
                assert!(e.start < e.end);
            }
            // The BOM and the comment belong to the first event; the second starts right
            // after the first's CRLF.
            assert_eq!(events[0].start, 0);
            let first_end = SAMPLE.find("\r\n\r\n").map(|i| i + 4);
            assert_eq!(usize::try_from(events[1].start).ok(), first_end);
            assert_eq!(
                events[0].end + 1,
                events[1].start,
                "the LF after the CR is skipped"
            );
        }
    }

    #[test]
    fn the_unfinished_event_is_known_until_its_blank_line() {
        let mut p = SseParser::new(1 << 20);
        let mut out = Vec::new();
        assert_eq!(p.pending_start(), None);
        assert_eq!(
            p.feed_events(b"data: a\n\nid: 2\ndata: {\"x\"", &mut out),
            Ok(())
        );
        assert_eq!(out.len(), 1);
        assert_eq!(p.pending_start(), Some(9));
        assert_eq!(p.feed_events(b":1}\r", &mut out), Ok(()));
        assert_eq!(p.pending_start(), Some(9));
        assert_eq!(p.feed_events(b"\n\r", &mut out), Ok(()));
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].data, "{\"x\":1}");
        assert_eq!((out[1].start, out[1].end), (9, 31));
        // The CR ended the event; its LF, when it comes, is not a new event.
        assert_eq!(p.pending_start(), None);
        assert_eq!(p.feed_events(b"\n", &mut out), Ok(()));
        assert_eq!(p.pending_start(), None);
        assert_eq!(p.position(), 32);
        assert_eq!(p.feed_events(b": ping", &mut out), Ok(()));
        assert_eq!(p.pending_start(), Some(32));
    }
}
