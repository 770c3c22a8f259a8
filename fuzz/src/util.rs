//! Small helpers shared by the checks.

use atmost_filter::call::reply::LocalReply;
use serde_json::Value;

/// A tiny deterministic PRNG (xorshift64*), so the checks are reproducible from the input.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: &[u8]) -> Rng {
        // FNV-1a over the seed, never zero.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in seed {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        Rng(h | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % (n as u64)) as usize
    }
}

/// Every local reply is a JSON body with a JSON `content-type`.
pub fn assert_reply_is_json(reply: &LocalReply) -> Value {
    assert_eq!(
        reply.header("content-type"),
        Some("application/json"),
        "local reply without JSON content-type: {reply:?}"
    );
    match reply.body_json() {
        Some(v) => v,
        None => panic!("local reply body is not JSON: {reply:?}"),
    }
}

/// A JSON-RPC error reply: `{"jsonrpc":"2.0","id":<string|number|null>,"error":{"code":<int>,"message":<string>}}`.
pub fn assert_rpc_error(reply: &LocalReply) -> (Value, i64) {
    let v = assert_reply_is_json(reply);
    assert_eq!(v["jsonrpc"], "2.0", "{v}");
    let id = v["id"].clone();
    assert!(
        id.is_null() || id.is_string() || id.is_number(),
        "error reply id is {id}"
    );
    assert!(v["error"]["message"].is_string(), "{v}");
    let code = match v["error"]["code"].as_i64() {
        Some(c) => c,
        None => panic!("error reply code is not an integer: {v}"),
    };
    (id, code)
}
