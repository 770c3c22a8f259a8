//! `sse`: the incremental `text/event-stream` parser on an arbitrary byte stream, split at
//! arbitrary points.
//!
//! Input: byte 0 picks the event size limit (large, or a small one so the limit is hit),
//! bytes 1..3 seed the split points, the rest is the stream. Asserts:
//! - fed whole, fed byte by byte and fed in random chunks, the parser yields the same
//!   events, the same last event id and the same result (`Ok` / `TooLarge`);
//! - after `TooLarge` it stays dead and yields nothing more;
//! - without `TooLarge`, the events and last event id equal those of a simple
//!   whole-buffer reference parser written from the WHATWG EventSource rules (lines end at
//!   CRLF, CR or LF; a leading BOM is dropped; `:` comments; `data` lines joined by LF;
//!   an event is dispatched at a blank line when it has data; non-UTF-8 data is skipped;
//!   `id` without NUL sets the last event id when its event ends);
//! - no event holds CR, and a last event id holds no CR, LF or NUL.

use crate::util::Rng;
use atmost_filter::parse::sse::{SseParser, TooLarge};

type Run = (Vec<String>, Option<String>, Result<(), TooLarge>);

fn feed_chunks<'a>(max: usize, chunks: impl Iterator<Item = &'a [u8]>) -> Run {
    let mut p = SseParser::new(max);
    let mut events = Vec::new();
    let mut res = Ok(());
    for c in chunks {
        let before = events.len();
        let r = p.feed(c, &mut events);
        if res.is_err() {
            assert_eq!(r, Err(TooLarge), "a dead parser came back");
            assert_eq!(events.len(), before, "a dead parser yielded events");
        }
        if r.is_err() {
            res = r;
        }
    }
    (events, p.last_event_id().map(str::to_string), res)
}

/// Whole-buffer reference: `(events, last event id)`. The state machine check reads the
/// upstream's answers with it too.
pub(crate) fn reference(stream: &[u8]) -> (Vec<String>, Option<String>) {
    let stream = stream.strip_prefix(&[0xef, 0xbb, 0xbf]).unwrap_or(stream);
    // Complete lines only: bytes after the last line end never form a line.
    let mut lines: Vec<&[u8]> = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < stream.len() {
        match stream[i] {
            b'\r' => {
                lines.push(&stream[start..i]);
                if stream.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            b'\n' => {
                lines.push(&stream[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    let mut events = Vec::new();
    let mut data: Option<Vec<u8>> = None;
    let mut id_buffer: Option<String> = None;
    let mut last_id: Option<String> = None;
    for line in lines {
        if line.is_empty() {
            if id_buffer.is_some() {
                last_id.clone_from(&id_buffer);
            }
            if let Some(mut d) = data.take() {
                d.pop(); // the LF after the last data line
                if let Ok(s) = String::from_utf8(d) {
                    events.push(s);
                }
            }
            continue;
        }
        if line[0] == b':' {
            continue;
        }
        let (field, value) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                let d = data.get_or_insert_with(Vec::new);
                d.extend_from_slice(value);
                d.push(b'\n');
            }
            b"id" if !value.contains(&0) => {
                if let Ok(s) = std::str::from_utf8(value) {
                    id_buffer = Some(s.to_string());
                }
            }
            _ => {}
        }
    }
    (events, last_id)
}

pub fn check(data: &[u8]) {
    if data.len() < 3 {
        return;
    }
    let max = match data[0] {
        0..=191 => 1 << 20,
        n => usize::from(n - 191), // 1..=64
    };
    let mut rng = Rng::new(&data[1..3]);
    let stream = &data[3..];

    let whole = feed_chunks(max, std::iter::once(stream));
    let bytewise = feed_chunks(max, stream.chunks(1));
    assert_eq!(whole, bytewise, "byte by byte differs from whole");

    let mut cuts = vec![0, stream.len()];
    for _ in 0..rng.below(8) {
        cuts.push(rng.below(stream.len() + 1));
    }
    cuts.sort_unstable();
    let chunked = feed_chunks(max, cuts.windows(2).map(|w| &stream[w[0]..w[1]]));
    assert_eq!(whole, chunked, "chunks at {cuts:?} differ from whole");

    // Splits must not matter even with empty chunks in between.
    let with_empty = feed_chunks(
        max,
        cuts.windows(2)
            .flat_map(|w| [&stream[w[0]..w[1]], &b""[..]]),
    );
    assert_eq!(whole, with_empty);

    let (events, last_id, res) = whole;
    for e in &events {
        assert!(!e.contains('\r'), "event holds CR: {e:?}");
    }
    if let Some(id) = &last_id {
        assert!(!id.contains(['\r', '\n', '\0']), "last event id {id:?}");
    }
    if res.is_ok() {
        assert_eq!(
            (events, last_id),
            reference(stream),
            "differs from the reference"
        );
    }
}
