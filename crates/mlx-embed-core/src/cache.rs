//! The embedding cache: an LRU of raw pooled vectors keyed by an input's
//! exact token ids, bounded in bytes, with single-flight misses.
//!
//! The key is what the model would see (token ids after prompt, special
//! tokens and truncation, plus type ids), so two inputs share an entry only
//! when the model would compute the same vector. A batcher serves one model,
//! so the model is implicit in the cache that belongs to it. Vectors are
//! stored before `dimensions` and normalization, so an answer from the cache
//! is bitwise the answer from the model.
//!
//! Single flight: the first lookup of a missing key becomes its [`Lead`]
//! and computes it; concurrent lookups of that key [`Follow`] it and get the
//! leader's vector, unless the leader is less urgent (then they lead a
//! computation of their own in their own lane, which later callers follow:
//! a query never waits in the bulk lane). A lead travels with its request
//! and is published where the vector is delivered, so a vector computed for
//! a caller that has left still reaches the callers that joined it (and is
//! stored). A lead whose input is never computed (its batch failed, or its
//! caller left before it ran) publishes nothing: its followers are woken
//! with `None` and look up again, so one of them leads the next try. Nobody
//! waits on a leader that is gone, and nobody gets a vector computed for
//! another key.
//!
//! Accounting: an entry costs its vector, its ids and [`ENTRY_OVERHEAD`]
//! bytes for the bookkeeping around them; the total never exceeds the
//! capacity (an entry larger than the whole cache is not stored).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::recorder::lock;
use crate::Priority;

/// Bytes charged per entry beyond its vector's and ids' own bytes: the
/// shared key (Arc header and two Vecs, 64), the vector's Arc header (16),
/// the list node in the slab and the hash-map slot, both with the slack
/// their growth leaves (about 110 and 30), and the allocator's own header
/// on each of the three heap blocks (up to 3 x 16), rounded up. The
/// allocator-counted test (`tests/cache_memory.rs`) measures about 220 to 250
/// bytes per entry before allocator headers, so the accounted total stays
/// above the real one.
pub const ENTRY_OVERHEAD: usize = 320;

/// What the model sees of one input: the cache key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct CacheKey {
    pub ids: Vec<u32>,
    pub type_ids: Option<Vec<u32>>,
    /// The same ids pool differently with their prompt left out.
    pub pool_start: u32,
    /// The same ids give another vector under another task adapter: 0 for
    /// none, 1 + the adapter's index otherwise (a plain u32, not an
    /// `Option`, keeps the key the size [`ENTRY_OVERHEAD`] accounts for).
    pub adapter: u32,
}

impl CacheKey {
    /// [`CacheKey::adapter`] for an input's [`crate::Encoded::adapter`].
    pub(crate) fn adapter_of(adapter: Option<u32>) -> u32 {
        adapter.map_or(0, |i| i + 1)
    }

    fn bytes(&self) -> usize {
        4 * (self.ids.len() + self.type_ids.as_ref().map_or(0, Vec::len))
    }
}

/// Cache figures for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheMetrics {
    /// Configured capacity in bytes (0: the cache is off).
    pub capacity_bytes: u64,
    /// Bytes accounted to the stored entries.
    pub bytes: u64,
    /// Vectors stored.
    pub entries: u64,
    /// Inputs answered from the cache, including those that waited for a
    /// concurrent computation of the same key.
    pub hits: u64,
    /// Inputs the model computed for the cache (each key once, however many
    /// asked; a lead that gave up before its vector counts nothing).
    pub misses: u64,
}

type Flight = watch::Receiver<Option<Arc<[f32]>>>;

struct FlightEntry {
    /// The flight's number, so a leader only ever removes its own flight.
    id: u64,
    /// The leader's lane: only callers of that lane or a lower one follow it.
    priority: Priority,
    rx: Flight,
}

const NIL: usize = usize::MAX;

struct Node {
    key: Arc<CacheKey>,
    vector: Arc<[f32]>,
    bytes: usize,
    /// Toward the most recently used end.
    prev: usize,
    /// Toward the least recently used end.
    next: usize,
}

/// The LRU list (a doubly linked list over a slab) and the flights in progress.
struct Lru {
    map: HashMap<Arc<CacheKey>, usize>,
    slab: Vec<Option<Node>>,
    free: Vec<usize>,
    /// Most recently used.
    head: usize,
    /// Least recently used: evicted first.
    tail: usize,
    bytes: usize,
    /// Keys being computed: who leads each, and the channel it publishes on.
    flights: HashMap<Arc<CacheKey>, FlightEntry>,
    next_flight: u64,
}

impl Lru {
    fn node(&mut self, i: usize) -> &mut Node {
        self.slab[i].as_mut().expect("linked nodes are live")
    }

    fn unlink(&mut self, i: usize) {
        let (prev, next) = {
            let n = self.node(i);
            (n.prev, n.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.node(p).next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.node(n).prev = prev,
        }
    }

    fn push_front(&mut self, i: usize) {
        let head = self.head;
        {
            let n = self.node(i);
            n.prev = NIL;
            n.next = head;
        }
        match head {
            NIL => self.tail = i,
            h => self.node(h).prev = i,
        }
        self.head = i;
    }

    fn get(&mut self, key: &CacheKey) -> Option<Arc<[f32]>> {
        let i = *self.map.get(key)?;
        if self.head != i {
            self.unlink(i);
            self.push_front(i);
        }
        Some(self.node(i).vector.clone())
    }

    fn evict_lru(&mut self) {
        let i = self.tail;
        debug_assert_ne!(i, NIL, "evicting from an empty cache");
        self.unlink(i);
        let node = self.slab[i].take().expect("tail is live");
        self.map.remove(&node.key);
        self.bytes -= node.bytes;
        self.free.push(i);
    }

    fn insert(&mut self, key: Arc<CacheKey>, vector: Arc<[f32]>, capacity: usize) {
        let bytes = 4 * vector.len() + key.bytes() + ENTRY_OVERHEAD;
        if bytes > capacity || self.map.contains_key(&key) {
            return;
        }
        while self.bytes + bytes > capacity {
            self.evict_lru();
        }
        let node = Node {
            key: key.clone(),
            vector,
            bytes,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slab[i] = Some(node);
                i
            }
            None => {
                self.slab.push(Some(node));
                self.slab.len() - 1
            }
        };
        self.push_front(i);
        self.map.insert(key, i);
        self.bytes += bytes;
        debug_assert!(self.bytes <= capacity, "cache over its capacity");
        debug_assert_eq!(self.map.len() + self.free.len(), self.slab.len());
    }
}

/// The cache of one batcher.
pub(crate) struct Cache {
    lru: Mutex<Lru>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// The outcome of a lookup.
pub(crate) enum Lookup {
    Hit(Arc<[f32]>),
    /// Nobody has it nor is computing it: compute it and [`Lead::publish`].
    Lead(Lead),
    /// Someone is computing it: [`Follow::wait`] for them.
    Follow(Follow),
}

/// The duty to compute one key. Dropping it unpublished (its input failed
/// or was never computed) ends the flight with no vector, waking the followers.
pub(crate) struct Lead {
    cache: Arc<Cache>,
    key: Arc<CacheKey>,
    flight: u64,
    tx: watch::Sender<Option<Arc<[f32]>>>,
}

/// A wait for another caller's computation of the same key.
pub(crate) struct Follow {
    cache: Arc<Cache>,
    rx: Flight,
}

impl Cache {
    /// A cache of `capacity` bytes; `None` for zero (caching off).
    pub fn new(capacity: usize) -> Option<Arc<Self>> {
        (capacity > 0).then(|| {
            Arc::new(Self {
                lru: Mutex::new(Lru {
                    map: HashMap::new(),
                    slab: Vec::new(),
                    free: Vec::new(),
                    head: NIL,
                    tail: NIL,
                    bytes: 0,
                    flights: HashMap::new(),
                    next_flight: 0,
                }),
                capacity,
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
            })
        })
    }

    /// Looks `key` up for a caller in `priority`'s lane. A caller never
    /// follows a less urgent leader (it would wait in that leader's lane):
    /// it leads its own computation instead, and later callers follow it.
    pub fn lookup(self: &Arc<Self>, key: CacheKey, priority: Priority) -> Lookup {
        let mut lru = lock(&self.lru);
        if let Some(vector) = lru.get(&key) {
            drop(lru);
            self.hits.fetch_add(1, Relaxed);
            return Lookup::Hit(vector);
        }
        if let Some(flight) = lru.flights.get(&key) {
            if flight.priority <= priority {
                return Lookup::Follow(Follow {
                    cache: self.clone(),
                    rx: flight.rx.clone(),
                });
            }
        }
        let key = Arc::new(key);
        let (tx, rx) = watch::channel(None);
        let flight = lru.next_flight;
        lru.next_flight += 1;
        // Replaces a less urgent flight for later callers; its own followers
        // keep their channel and still get its vector.
        lru.flights.insert(
            key.clone(),
            FlightEntry {
                id: flight,
                priority,
                rx,
            },
        );
        drop(lru);
        Lookup::Lead(Lead {
            cache: self.clone(),
            key,
            flight,
            tx,
        })
    }

    /// Drops every stored vector. Computations in flight are untouched:
    /// their followers still get their vectors, which are stored as usual.
    pub fn clear(&self) {
        let mut lru = lock(&self.lru);
        lru.map.clear();
        lru.slab.clear();
        lru.free.clear();
        (lru.head, lru.tail, lru.bytes) = (NIL, NIL, 0);
    }

    /// Zeroes the hit and miss counts (the entries stay).
    pub fn reset_counts(&self) {
        self.hits.store(0, Relaxed);
        self.misses.store(0, Relaxed);
    }

    pub fn metrics(&self) -> CacheMetrics {
        let lru = lock(&self.lru);
        CacheMetrics {
            capacity_bytes: self.capacity as u64,
            bytes: lru.bytes as u64,
            entries: lru.map.len() as u64,
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
        }
    }
}

impl Lead {
    /// Stores the computed vector and hands it to every follower.
    pub fn publish(self, vector: &[f32]) {
        // Counted here, not at the lookup: a lead given up (its caller left
        // before it ran, its batch failed) computed nothing, and its key is
        // led again.
        self.cache.misses.fetch_add(1, Relaxed);
        let vector: Arc<[f32]> = vector.into();
        {
            let mut lru = lock(&self.cache.lru);
            lru.insert(self.key.clone(), vector.clone(), self.cache.capacity);
        }
        // Followers hold receivers; the value reaches them even if the entry
        // was too large to keep.
        self.tx.send_replace(Some(vector));
        // Drop ends the flight.
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        let mut lru = lock(&self.cache.lru);
        if lru
            .flights
            .get(&self.key)
            .is_some_and(|f| f.id == self.flight)
        {
            lru.flights.remove(&self.key);
        }
        // `tx` drops after this: unpublished, the followers see the channel close.
    }
}

impl Follow {
    /// The leader's vector, or `None` if the leader gave up: look up again.
    pub async fn wait(mut self) -> Option<Arc<[f32]>> {
        // `wait_for` looks at the current value before the closed state, so a
        // vector published just before the leader dropped is still seen.
        let vector = match self.rx.wait_for(Option::is_some).await {
            Ok(v) => v.clone(),
            Err(_) => None,
        };
        if vector.is_some() {
            self.cache.hits.fetch_add(1, Relaxed);
        }
        vector
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: u32, len: usize) -> CacheKey {
        CacheKey {
            ids: vec![id; len],
            type_ids: None,
            pool_start: 0,
            adapter: 0,
        }
    }

    fn entry_bytes(dim: usize, len: usize) -> usize {
        4 * dim + 4 * len + ENTRY_OVERHEAD
    }

    fn lead(cache: &Arc<Cache>, k: CacheKey) -> Lead {
        match cache.lookup(k, Priority::Normal) {
            Lookup::Lead(l) => l,
            _ => panic!("expected to lead"),
        }
    }

    #[test]
    fn zero_capacity_is_off() {
        assert!(Cache::new(0).is_none());
    }

    #[test]
    fn stays_within_capacity_evicting_least_recently_used() {
        let per = entry_bytes(8, 3);
        let cache = Cache::new(3 * per + per / 2).unwrap();
        for id in 0..3 {
            lead(&cache, key(id, 3)).publish(&[id as f32; 8]);
        }
        // Touch 0 so 1 is the least recently used.
        assert!(matches!(cache.lookup(key(0, 3), Priority::Normal), Lookup::Hit(v) if v[0] == 0.0));
        lead(&cache, key(3, 3)).publish(&[3.0; 8]);
        let m = cache.metrics();
        assert_eq!((m.entries, m.bytes), (3, 3 * per as u64));
        assert!(m.bytes <= m.capacity_bytes);
        assert!(
            matches!(cache.lookup(key(1, 3), Priority::Normal), Lookup::Lead(_)),
            "1 evicted"
        );
        for id in [0, 2, 3] {
            assert!(
                matches!(cache.lookup(key(id, 3), Priority::Normal), Lookup::Hit(v) if v[0] == id as f32),
                "{id} kept"
            );
        }
    }

    #[test]
    fn many_inserts_never_exceed_the_capacity() {
        let capacity = 10_000;
        let cache = Cache::new(capacity).unwrap();
        for id in 0..2_000u32 {
            let len = (id % 37) as usize + 1;
            lead(&cache, key(id, len)).publish(&[1.0; 16]);
            let m = cache.metrics();
            assert!(m.bytes <= capacity as u64, "{} > {capacity}", m.bytes);
        }
        let m = cache.metrics();
        assert!(
            m.entries > 10,
            "the cache holds many entries ({})",
            m.entries
        );
        assert_eq!(m.misses, 2_000);
    }

    #[test]
    fn an_entry_larger_than_the_cache_is_served_but_not_kept() {
        let cache = Cache::new(100).unwrap();
        let leader = lead(&cache, key(7, 50));
        let Lookup::Follow(follower) = cache.lookup(key(7, 50), Priority::Normal) else {
            panic!("expected to follow");
        };
        leader.publish(&[7.0; 64]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(
            rt.block_on(follower.wait()).as_deref(),
            Some(&[7.0f32; 64][..])
        );
        assert_eq!(cache.metrics().entries, 0);
    }

    #[test]
    fn type_ids_are_part_of_the_key() {
        let cache = Cache::new(1 << 20).unwrap();
        let plain = key(1, 2);
        let typed = CacheKey {
            type_ids: Some(vec![0, 1]),
            ..key(1, 2)
        };
        lead(&cache, plain.clone()).publish(&[1.0]);
        assert!(matches!(
            cache.lookup(typed, Priority::Normal),
            Lookup::Lead(_)
        ));
        assert!(matches!(
            cache.lookup(plain, Priority::Normal),
            Lookup::Hit(_)
        ));
    }

    #[test]
    fn the_pool_start_is_part_of_the_key() {
        // A prompt's ids sent as token ids pool with the prompt; the same
        // ids from text pool without it: two vectors.
        let cache = Cache::new(1 << 20).unwrap();
        let with_prompt = key(1, 4);
        let without = CacheKey {
            pool_start: 2,
            ..key(1, 4)
        };
        lead(&cache, with_prompt.clone()).publish(&[1.0]);
        assert!(matches!(
            cache.lookup(without.clone(), Priority::Normal),
            Lookup::Lead(_)
        ));
        assert!(matches!(
            cache.lookup(with_prompt, Priority::Normal),
            Lookup::Hit(_)
        ));
    }

    #[test]
    fn the_task_adapter_is_part_of_the_key() {
        // jina-embeddings-v3's tasks with no prompt run the same ids under
        // different adapters: one vector each, and the base weights' apart.
        let cache = Cache::new(1 << 20).unwrap();
        let base = key(1, 4);
        let separation = CacheKey {
            adapter: CacheKey::adapter_of(Some(2)),
            ..key(1, 4)
        };
        let matching = CacheKey {
            adapter: CacheKey::adapter_of(Some(4)),
            ..key(1, 4)
        };
        assert_eq!(CacheKey::adapter_of(None), base.adapter);
        assert_ne!(CacheKey::adapter_of(Some(0)), base.adapter);
        lead(&cache, separation.clone()).publish(&[1.0]);
        for other in [base, matching] {
            assert!(matches!(
                cache.lookup(other, Priority::Normal),
                Lookup::Lead(_)
            ));
        }
        assert!(matches!(
            cache.lookup(separation, Priority::Normal),
            Lookup::Hit(_)
        ));
    }

    #[test]
    fn a_caller_never_follows_a_less_urgent_leader() {
        let cache = Cache::new(1 << 20).unwrap();
        let bulk = lead(&cache, key(5, 2));
        // Same lane or less urgent: follow.
        assert!(matches!(
            cache.lookup(key(5, 2), Priority::Low),
            Lookup::Follow(_)
        ));
        assert!(matches!(
            cache.lookup(key(5, 2), Priority::Normal),
            Lookup::Follow(_)
        ));
        // More urgent: lead its own computation, which later callers follow.
        let Lookup::Lead(query) = cache.lookup(key(5, 2), Priority::High) else {
            panic!("a query must not wait on a normal-lane leader");
        };
        assert!(matches!(
            cache.lookup(key(5, 2), Priority::High),
            Lookup::Follow(_)
        ));
        // The first leader finishing leaves the newer flight in place.
        bulk.publish(&[1.0; 4]);
        assert!(matches!(
            cache.lookup(key(5, 2), Priority::High),
            Lookup::Hit(_)
        ));
        query.publish(&[1.0; 4]);
        assert_eq!(cache.metrics().entries, 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn followers_of_a_leader_that_gives_up_are_woken_to_retry() {
        let cache = Cache::new(1 << 20).unwrap();
        let leader = lead(&cache, key(1, 4));
        let followers: Vec<_> = (0..5)
            .map(|_| match cache.lookup(key(1, 4), Priority::Normal) {
                Lookup::Follow(f) => tokio::spawn(f.wait()),
                _ => panic!("expected to follow"),
            })
            .collect();
        tokio::task::yield_now().await;
        drop(leader);
        for f in followers {
            let got = tokio::time::timeout(std::time::Duration::from_secs(5), f)
                .await
                .expect("woken, not hung")
                .unwrap();
            assert_eq!(got, None);
        }
        // The next lookup leads a fresh flight.
        let again = lead(&cache, key(1, 4));
        again.publish(&[2.0; 4]);
        // The abandoned lead computed nothing, so only the published one is a miss.
        let m = cache.metrics();
        assert_eq!((m.hits, m.misses, m.entries), (0, 1, 1));
    }
}
