//! Eviction policies of a cache shard: LRU, CLOCK and S3-FIFO.
//!
//! Queues hold `(key, generation)`; an entry removed or re-inserted leaves
//! stale queue items behind, which eviction skips (lazy deletion keeps
//! every operation O(1) amortised).

use std::collections::{HashMap, HashSet, VecDeque};

use crate::{Slice, SliceKey};

/// How a shard chooses what to evict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// CLOCK (second chance): one reference bit per entry.
    Clock,
    /// S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main
    /// FIFO with a 2-bit frequency, and a ghost FIFO of evicted keys.
    S3Fifo,
}

/// Per-entry bookkeeping.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    generation: u64,
    weight: u64,
    /// LRU: generation of the latest touch is `generation`; CLOCK: the
    /// reference bit (0/1); S3-FIFO: access frequency 0..=3.
    freq: u8,
    in_small: bool,
}

/// The slices of a shard by key. A fast hasher with a per-map random
/// seed: keys come from guest offsets, lookups are on every request.
pub(crate) type Map = HashMap<SliceKey, (Slice, Meta), foldhash::fast::RandomState>;

#[derive(Debug)]
pub(crate) struct Queues {
    policy: Policy,
    generation: u64,
    main: VecDeque<(SliceKey, u64)>,
    small: VecDeque<(SliceKey, u64)>,
    small_bytes: u64,
    small_target: u64,
    ghost: VecDeque<SliceKey>,
    ghost_set: HashSet<SliceKey, foldhash::fast::RandomState>,
}

impl Queues {
    pub(crate) fn new(policy: Policy, budget: u64) -> Self {
        Self {
            policy,
            generation: 0,
            main: VecDeque::new(),
            small: VecDeque::new(),
            small_bytes: 0,
            small_target: budget / 10,
            ghost: VecDeque::new(),
            ghost_set: HashSet::default(),
        }
    }

    fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    /// Registers a new entry and returns its bookkeeping.
    pub(crate) fn admit(&mut self, key: SliceKey, weight: u64) -> Meta {
        let generation = self.next_generation();
        let mut meta = Meta {
            generation,
            weight,
            freq: 0,
            in_small: false,
        };
        match self.policy {
            Policy::Lru | Policy::Clock => self.main.push_back((key, generation)),
            Policy::S3Fifo => {
                if self.ghost_set.remove(&key) {
                    self.main.push_back((key, generation));
                } else {
                    meta.in_small = true;
                    self.small_bytes += weight;
                    self.small.push_back((key, generation));
                }
            }
        }
        meta
    }

    /// Records a hit on an entry.
    pub(crate) fn hit(&mut self, key: SliceKey, meta: &mut Meta) {
        match self.policy {
            Policy::Lru => {
                meta.generation = self.next_generation();
                self.main.push_back((key, meta.generation));
            }
            Policy::Clock => meta.freq = 1,
            Policy::S3Fifo => meta.freq = (meta.freq + 1).min(3),
        }
    }

    /// Drops stale queue items (left by hits under LRU, and by removals)
    /// once they outnumber live entries 4:1, so the queues stay bounded.
    pub(crate) fn compact(&mut self, map: &Map) {
        let live = |(k, g): &(SliceKey, u64)| map.get(k).is_some_and(|(_, m)| m.generation == *g);
        if self.main.len() > 64 && self.main.len() > 4 * map.len() {
            self.main.retain(live);
        }
        if self.small.len() > 64 && self.small.len() > 4 * map.len() {
            self.small.retain(live);
        }
    }

    /// Items in the queues (live and stale).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.main.len() + self.small.len()
    }

    /// Called when an entry leaves the map other than by eviction.
    pub(crate) fn forget(&mut self, meta: &Meta) {
        if meta.in_small {
            self.small_bytes -= meta.weight;
        }
    }

    /// Chooses the next victim (still in `map`), updating queues.
    pub(crate) fn evict(&mut self, map: &mut Map) -> Option<SliceKey> {
        loop {
            let from_small = self.policy == Policy::S3Fifo
                && !self.small.is_empty()
                && (self.small_bytes > self.small_target || self.main.is_empty());
            let queue = if from_small {
                &mut self.small
            } else {
                &mut self.main
            };
            let (key, generation) = queue.pop_front()?;
            let Some((_, meta)) = map.get_mut(&key) else {
                continue;
            };
            if meta.generation != generation {
                continue;
            }
            match (self.policy, from_small) {
                (Policy::Lru, _) => return Some(key),
                (Policy::Clock, _) | (Policy::S3Fifo, false) => {
                    if meta.freq > 0 {
                        meta.freq -= 1;
                        self.main.push_back((key, generation));
                    } else {
                        return Some(key);
                    }
                }
                (Policy::S3Fifo, true) => {
                    meta.in_small = false;
                    self.small_bytes -= meta.weight;
                    if meta.freq > 0 {
                        meta.freq = 0;
                        self.main.push_back((key, generation));
                    } else {
                        self.ghost.push_back(key);
                        self.ghost_set.insert(key);
                        while self.ghost.len() > map.len().max(16) {
                            if let Some(old) = self.ghost.pop_front() {
                                self.ghost_set.remove(&old);
                            }
                        }
                        return Some(key);
                    }
                }
            }
        }
    }
}
