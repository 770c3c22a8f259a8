//! The replay cache: the nonces of accepted signatures, kept until their signatures expire,
//! in Envoy's shared data so every worker's VM sees the others'.
//!
//! Envoy's shared data (proxy-wasm ABI 0.2.1, as SDK 0.2.5 speaks it) is a map of keys to
//! bytes with a version per key: a read returns the value and its version, a write may name
//! the version it expects and fails when another write came between (compare-and-swap). A
//! key cannot be removed (writing nothing leaves it, empty), and a write without a version,
//! or to a key that does not exist, always succeeds. So the cache is a fixed number of
//! slots, one key each, created when the plugin is configured: a nonce's hash picks its
//! slot, and the slot's value is up to [`SLOT_ENTRIES`] entries `(id, keep_until)`. A write
//! drops the slot's expired entries, adds the new one and names the version it read;
//! losing the race, it reads again, at most [`MAX_CAS_TRIES`] times. A slot full of
//! unexpired entries, a race lost every time, or a slot that is missing, is answered
//! [`Record::Unavailable`]: the call is refused, never accepted unrecorded.

use sha2::{Digest, Sha256};

/// Entries one slot holds.
pub const SLOT_ENTRIES: usize = 32;
/// Reads and writes of one slot before giving up on a contended slot.
pub const MAX_CAS_TRIES: usize = 8;
/// Bytes of one entry: the nonce's 16-byte id, then `keep_until` (u64, big-endian).
const ENTRY_BYTES: usize = 24;
/// Prefix of the slots' shared-data keys.
pub const KEY_PREFIX: &str = "atmost.verify.replay.";

/// One slot as shared data holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotValue {
    pub bytes: Vec<u8>,
    /// The version the host gave with it (compare-and-swap).
    pub version: u32,
}

/// Where the slots live: Envoy's shared data in the module, memory in tests.
pub trait SharedSlots {
    /// The slot's value; `None` when the slot does not exist (or cannot be read).
    fn get(&mut self, key: &str) -> Option<SlotValue>;
    /// Writes the slot if its version is still `version`; `false` when it is not (or the
    /// write failed).
    fn set(&mut self, key: &str, value: &[u8], version: u32) -> bool;
    /// Creates the slot, empty, with an unconditional write: only for a slot `get` found
    /// missing.
    fn create(&mut self, key: &str);
}

/// What became of one nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// Not seen before; now recorded.
    Recorded,
    /// Seen before and not yet expired.
    Replayed,
    /// Could not be recorded: the slot is full of unexpired entries, or lost the race
    /// [`MAX_CAS_TRIES`] times, or is missing.
    Unavailable(Unavailable),
}

/// Why a nonce could not be recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unavailable {
    Full,
    Contended,
    Missing,
}

/// The cache's shape: how many slots, derived from the configured number of entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCache {
    slots: u32,
}

impl ReplayCache {
    /// A cache of at least `entries` entries (rounded up to whole slots).
    pub fn new(entries: u64) -> ReplayCache {
        let slots = entries.div_ceil(SLOT_ENTRIES as u64).max(1);
        ReplayCache {
            slots: u32::try_from(slots).unwrap_or(u32::MAX),
        }
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The shared-data key of one slot.
    pub fn key(slot: u32) -> String {
        format!("{KEY_PREFIX}{slot}")
    }

    /// Creates every slot that does not exist yet; existing slots (another worker's, or
    /// this plugin's before a reconfiguration) keep their entries.
    pub fn create_slots(&self, store: &mut dyn SharedSlots) {
        for slot in 0..self.slots {
            let key = ReplayCache::key(slot);
            if store.get(&key).is_none() {
                store.create(&key);
            }
        }
    }

    /// The nonce's 16-byte id and its slot.
    fn place(&self, nonce: &str) -> ([u8; 16], u32) {
        let hash = Sha256::digest(nonce.as_bytes());
        let mut id = [0u8; 16];
        id.copy_from_slice(&hash[..16]);
        let mut pick = [0u8; 8];
        pick.copy_from_slice(&hash[16..24]);
        let slot = u64::from_be_bytes(pick) % u64::from(self.slots);
        (id, u32::try_from(slot).unwrap_or(0))
    }

    /// Records `nonce` until `keep_until` (Unix seconds) unless it is there and unexpired
    /// at `now`.
    pub fn record(
        &self,
        store: &mut dyn SharedSlots,
        nonce: &str,
        keep_until: u64,
        now: u64,
    ) -> Record {
        let (id, slot) = self.place(nonce);
        let key = ReplayCache::key(slot);
        for _ in 0..MAX_CAS_TRIES {
            let Some(current) = store.get(&key) else {
                return Record::Unavailable(Unavailable::Missing);
            };
            let mut kept = Vec::with_capacity(current.bytes.len() + ENTRY_BYTES);
            for entry in current.bytes.chunks_exact(ENTRY_BYTES) {
                let mut until = [0u8; 8];
                until.copy_from_slice(&entry[16..]);
                if u64::from_be_bytes(until) < now {
                    continue;
                }
                if entry[..16] == id {
                    return Record::Replayed;
                }
                kept.extend_from_slice(entry);
            }
            if kept.len() / ENTRY_BYTES >= SLOT_ENTRIES {
                return Record::Unavailable(Unavailable::Full);
            }
            kept.extend_from_slice(&id);
            kept.extend_from_slice(&keep_until.to_be_bytes());
            if store.set(&key, &kept, current.version) {
                return Record::Recorded;
            }
        }
        Record::Unavailable(Unavailable::Contended)
    }
}

/// Shared data in memory, with the host's compare-and-swap rules (tests).
#[cfg(test)]
#[derive(Debug, Default)]
pub struct MemorySlots {
    pub map: std::collections::HashMap<String, SlotValue>,
    next_version: u32,
    /// Writes that fail as if another worker had written first.
    pub lose_races: usize,
}

#[cfg(test)]
impl SharedSlots for MemorySlots {
    fn get(&mut self, key: &str) -> Option<SlotValue> {
        self.map.get(key).cloned()
    }
    fn set(&mut self, key: &str, value: &[u8], version: u32) -> bool {
        if self.lose_races > 0 {
            self.lose_races -= 1;
            self.next_version += 1;
            if let Some(v) = self.map.get_mut(key) {
                v.version = self.next_version;
            }
            return false;
        }
        if self.map.get(key).is_some_and(|v| v.version != version) {
            return false;
        }
        self.create(key);
        if let Some(v) = self.map.get_mut(key) {
            v.bytes = value.to_vec();
        }
        true
    }
    fn create(&mut self, key: &str) {
        self.next_version += 1;
        self.map.insert(
            key.to_string(),
            SlotValue {
                bytes: Vec::new(),
                version: self.next_version,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(entries: u64) -> (ReplayCache, MemorySlots) {
        let cache = ReplayCache::new(entries);
        let mut store = MemorySlots::default();
        cache.create_slots(&mut store);
        (cache, store)
    }

    #[test]
    fn a_nonce_is_accepted_once_until_it_expires() {
        let (cache, mut store) = cache(1000);
        assert_eq!(cache.slots(), 32);
        assert_eq!(store.map.len(), 32);
        assert_eq!(
            cache.record(&mut store, "a/1/p/t", 110, 100),
            Record::Recorded
        );
        assert_eq!(
            cache.record(&mut store, "a/1/p/t", 110, 105),
            Record::Replayed
        );
        assert_eq!(
            cache.record(&mut store, "a/2/p/t", 110, 105),
            Record::Recorded
        );
        // Past `keep_until` the entry is dropped: the signature could not be accepted anyway.
        assert_eq!(
            cache.record(&mut store, "a/1/p/t", 130, 111),
            Record::Recorded
        );
    }

    #[test]
    fn creating_slots_again_keeps_their_entries() {
        let (cache, mut store) = cache(64);
        assert_eq!(cache.record(&mut store, "n", 200, 100), Record::Recorded);
        cache.create_slots(&mut store);
        assert_eq!(cache.record(&mut store, "n", 200, 100), Record::Replayed);
    }

    #[test]
    fn a_full_slot_refuses_until_its_entries_expire() {
        // One slot: every nonce lands in it.
        let (cache, mut store) = cache(1);
        assert_eq!(cache.slots(), 1);
        for i in 0..SLOT_ENTRIES {
            assert_eq!(
                cache.record(&mut store, &format!("n{i}"), 200, 100),
                Record::Recorded
            );
        }
        assert_eq!(
            cache.record(&mut store, "one more", 200, 100),
            Record::Unavailable(Unavailable::Full)
        );
        // A replay is still told apart from a full slot.
        assert_eq!(cache.record(&mut store, "n3", 200, 150), Record::Replayed);
        assert_eq!(
            cache.record(&mut store, "one more", 300, 201),
            Record::Recorded
        );
        let slot = store.map.get(&ReplayCache::key(0)).map(|v| v.bytes.len());
        assert_eq!(slot, Some(ENTRY_BYTES), "expired entries were dropped");
    }

    #[test]
    fn a_lost_race_reads_again_and_gives_up_after_the_bound() {
        let (cache, mut store) = cache(64);
        store.lose_races = MAX_CAS_TRIES - 1;
        assert_eq!(cache.record(&mut store, "n", 200, 100), Record::Recorded);
        store.lose_races = MAX_CAS_TRIES;
        assert_eq!(
            cache.record(&mut store, "m", 200, 100),
            Record::Unavailable(Unavailable::Contended)
        );
        // Nothing was recorded for the refused one.
        assert_eq!(cache.record(&mut store, "m", 200, 100), Record::Recorded);
    }

    #[test]
    fn a_missing_slot_is_never_created_on_the_request_path() {
        let cache = ReplayCache::new(64);
        let mut store = MemorySlots::default();
        assert_eq!(
            cache.record(&mut store, "n", 200, 100),
            Record::Unavailable(Unavailable::Missing)
        );
        assert!(store.map.is_empty());
    }

    #[test]
    fn two_writers_on_one_slot_cannot_both_record_the_same_nonce() {
        // Worker A reads the slot, worker B records the nonce, then A's write (naming the
        // version it read) fails, and A reads again and sees B's entry.
        let (cache, mut store) = cache(1);
        let key = ReplayCache::key(0);
        let stale = store.get(&key).map(|v| v.version).unwrap_or(0);
        assert_eq!(cache.record(&mut store, "n", 200, 100), Record::Recorded);
        assert!(!store.set(&key, b"", stale));
        assert_eq!(cache.record(&mut store, "n", 200, 100), Record::Replayed);
    }

    #[test]
    fn the_bound_rounds_up_to_whole_slots() {
        assert_eq!(ReplayCache::new(32).slots(), 1);
        assert_eq!(ReplayCache::new(33).slots(), 2);
        assert_eq!(ReplayCache::new(65_536).slots(), 2048);
    }
}
