//! [`PrefixCache`]: full KV pages identified by a chained hash of their tokens, shared by
//! refcount between sequences whose prompts start the same way, kept resident after their
//! last sequence leaves and evicted least-recently-used only when the pool runs dry.
//!
//! Ownership model: the cache holds ONE pool reference on every page it has registered, so a
//! page's refcount is always `sequences owning it + (1 if cached)`, and the pool's invariant
//! (free list exactly the pages with refcount 0) is unchanged. A cached page whose refcount is
//! 1 is held by the cache alone: it is *evictable* and sits in an LRU list; evicting it drops
//! the cache's reference and returns it to the free list.
//!
//! Identity: page `i` of a token sequence has key
//! `hash_page(key(i - 1), tokens[i * page_size..(i + 1) * page_size])` with
//! key(-1) = [`ROOT_HASH`], a 64-bit hash. The hash only indexes: a lookup also compares the
//! page's stored tokens and the identity (a never-reused serial number) of its parent entry,
//! so a 64-bit collision can cost a miss but never a wrong hit.

use std::collections::{BTreeMap, HashMap};

use crate::block_table::BlockTable;
use crate::pool::{BlockPool, PageId, PoolError};

/// Hash of the empty prefix: the parent key of a sequence's first page.
pub const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// Chained 64-bit hash of one full page: mixes the parent page's key with every token id
/// (multiply-rotate per token, a SplitMix64 finaliser at the end). Deterministic across runs
/// and platforms.
pub fn hash_page(parent_hash: u64, page_tokens: &[u32]) -> u64 {
    const MULTIPLIER: u64 = 0xff51_afd7_ed55_8ccd;
    let mut state = parent_hash ^ (page_tokens.len() as u64).wrapping_mul(MULTIPLIER);
    for &token in page_tokens {
        state = (state ^ u64::from(token))
            .wrapping_mul(MULTIPLIER)
            .rotate_left(31);
    }
    splitmix64(state)
}

fn splitmix64(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

/// What the cache knows about one registered page.
#[derive(Debug, Clone)]
struct CachedPage {
    key: u64,
    /// Unique, never reused registration number.
    serial: u64,
    /// Serial of the parent page's entry (`None` for a first page).
    parent_serial: Option<u64>,
    tokens: Vec<u32>,
    /// LRU tick while evictable (refcount 1, held by the cache alone).
    evictable_since: Option<u64>,
}

/// A change to the set of cached pages, in the order it happened: what an external KV-aware
/// router (NVIDIA Dynamo's KV events) needs to mirror which prefixes this cache holds.
/// Recorded only after [`PrefixCache::record_events`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full page was registered under `key`, after the page registered under `parent`
    /// (`None`: the sequence's first page), holding `tokens`.
    Stored {
        key: u64,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    /// The page registered under `key` was evicted.
    Removed { key: u64 },
}

/// A prefix match: the cached pages covering a token sequence's first full pages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Matched pages in token order.
    pub pages: Vec<PageId>,
    /// Chained key of each matched page (the parent key of the next page).
    pub keys: Vec<u64>,
}

/// The prefix cache over one [`BlockPool`]. Every method that changes refcounts takes the pool;
/// pass the same pool every time.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    page_size: usize,
    by_key: HashMap<u64, PageId>,
    entries: HashMap<PageId, CachedPage>,
    /// Evictable pages by the tick they became evictable (oldest first).
    lru: BTreeMap<u64, PageId>,
    next_tick: u64,
    next_serial: u64,
    /// Changes not yet taken by [`PrefixCache::take_events`]; `None`: not recording.
    events: Option<Vec<CacheEvent>>,
}

impl PrefixCache {
    /// An empty cache for pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        Self {
            page_size,
            by_key: HashMap::new(),
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            next_serial: 0,
            events: None,
        }
    }

    /// Starts (or stops, dropping what is pending) recording [`CacheEvent`]s. Pages
    /// registered before recording starts are not reported.
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(|| self.events.take().unwrap_or_default());
    }

    /// The events recorded since the last call, oldest first (empty when not recording).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages registered in the cache (shared or evictable).
    pub fn num_cached(&self) -> usize {
        self.entries.len()
    }

    /// Cached pages held by the cache alone (refcount 1): reclaimable on demand.
    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    /// Whether `page` is registered.
    pub fn contains(&self, page: PageId) -> bool {
        self.entries.contains_key(&page)
    }

    /// The tokens stored for a registered page.
    pub fn page_tokens(&self, page: PageId) -> Option<&[u32]> {
        self.entries.get(&page).map(|entry| entry.tokens.as_slice())
    }

    /// Registered pages, in no particular order.
    pub fn cached_pages(&self) -> impl Iterator<Item = PageId> + '_ {
        self.entries.keys().copied()
    }

    /// The keys of the registered pages, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_key.keys().copied()
    }

    /// Evictable pages, oldest first.
    pub fn evictable_pages(&self) -> impl Iterator<Item = PageId> + '_ {
        self.lru.values().copied()
    }

    /// The longest run of cached full pages equal to the start of `tokens`, at most
    /// `max_pages` pages. Reads only; take the pages with [`PrefixCache::acquire`].
    pub fn find(&self, tokens: &[u32], max_pages: usize) -> PrefixMatch {
        let mut found = PrefixMatch::default();
        let mut parent_key = ROOT_HASH;
        let mut parent_serial = None;
        for page_tokens in tokens.chunks_exact(self.page_size).take(max_pages) {
            let key = hash_page(parent_key, page_tokens);
            let Some(&page) = self.by_key.get(&key) else {
                break;
            };
            let Some(entry) = self.entries.get(&page) else {
                break;
            };
            if entry.parent_serial != parent_serial || entry.tokens != page_tokens {
                break;
            }
            found.pages.push(page);
            found.keys.push(key);
            parent_key = key;
            parent_serial = Some(entry.serial);
        }
        found
    }

    /// Adds one sequence reference to each page of `pages` (all registered), taking evictable
    /// ones off the LRU list. All or nothing on error.
    pub fn acquire(&mut self, pool: &mut BlockPool, pages: &[PageId]) -> Result<(), PoolError> {
        for (done, &page) in pages.iter().enumerate() {
            if let Err(error) = pool.incref(page) {
                for &undo in &pages[..done] {
                    let _ = pool.decref(undo);
                    self.mark_if_evictable(pool, undo);
                }
                return Err(error);
            }
            if let Some(entry) = self.entries.get_mut(&page) {
                if let Some(tick) = entry.evictable_since.take() {
                    self.lru.remove(&tick);
                }
            }
        }
        Ok(())
    }

    /// Registers the full page `page` holding `page_tokens` (exactly `page_size` tokens) whose
    /// parent is the page registered under `parent_key` (or [`ROOT_HASH`] for a first page),
    /// taking one cache reference. Returns the page's key when registered, `None` when it is
    /// not (already cached, the same content is already cached under another page, the
    /// parent is no longer cached, or the tokens are not one full page).
    pub fn insert(
        &mut self,
        pool: &mut BlockPool,
        page: PageId,
        parent_key: u64,
        page_tokens: &[u32],
    ) -> Result<Option<u64>, PoolError> {
        if page_tokens.len() != self.page_size || self.entries.contains_key(&page) {
            return Ok(None);
        }
        let parent_serial = if parent_key == ROOT_HASH {
            None
        } else {
            match self
                .by_key
                .get(&parent_key)
                .and_then(|parent| self.entries.get(parent))
            {
                Some(parent) => Some(parent.serial),
                None => return Ok(None),
            }
        };
        let key = hash_page(parent_key, page_tokens);
        if self.by_key.contains_key(&key) {
            return Ok(None);
        }
        pool.incref(page)?;
        self.by_key.insert(key, page);
        self.entries.insert(
            page,
            CachedPage {
                key,
                serial: self.next_serial,
                parent_serial,
                tokens: page_tokens.to_vec(),
                evictable_since: None,
            },
        );
        self.next_serial += 1;
        if let Some(events) = &mut self.events {
            events.push(CacheEvent::Stored {
                key,
                parent: (parent_key != ROOT_HASH).then_some(parent_key),
                tokens: page_tokens.to_vec(),
            });
        }
        self.mark_if_evictable(pool, page);
        Ok(Some(key))
    }

    /// Releases a sequence's block table: drops its reference to every page, last page first,
    /// so that a chain's tail becomes evictable before its head (the head is useful to more
    /// prompts). Cached pages left with only the cache's reference join the LRU list.
    pub fn release(
        &mut self,
        pool: &mut BlockPool,
        table: &mut BlockTable,
    ) -> Result<(), PoolError> {
        let pages = table.pages().to_vec();
        let result = table.release(pool);
        for &page in pages.iter().rev() {
            self.mark_if_evictable(pool, page);
        }
        result
    }

    /// Drops references to `pages` (not a block table's: e.g. an acquired match that could not
    /// be used), marking cached pages that become evictable.
    pub fn release_pages(
        &mut self,
        pool: &mut BlockPool,
        pages: &[PageId],
    ) -> Result<(), PoolError> {
        let mut first_error = None;
        for &page in pages.iter().rev() {
            if let Err(error) = pool.decref(page) {
                first_error.get_or_insert(error);
            }
            self.mark_if_evictable(pool, page);
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Evicts the least recently released evictable page: forgets it and returns it to the
    /// free list. `None` when nothing is evictable.
    pub fn evict_one(&mut self, pool: &mut BlockPool) -> Option<PageId> {
        let (_, page) = self.lru.pop_first()?;
        if let Some(entry) = self.entries.remove(&page) {
            if self.by_key.get(&entry.key) == Some(&page) {
                self.by_key.remove(&entry.key);
            }
            if let Some(events) = &mut self.events {
                events.push(CacheEvent::Removed { key: entry.key });
            }
        }
        let _ = pool.decref(page);
        Some(page)
    }

    /// Evicts LRU pages until the pool has at least `count` free pages. Returns whether it
    /// succeeded; when it cannot, evicts nothing.
    pub fn ensure_free(&mut self, pool: &mut BlockPool, count: usize) -> bool {
        if pool.num_free() + self.lru.len() < count {
            return false;
        }
        while pool.num_free() < count {
            if self.evict_one(pool).is_none() {
                return false;
            }
        }
        true
    }

    /// Evicts every evictable page (shared pages stay registered).
    pub fn evict_all(&mut self, pool: &mut BlockPool) {
        while self.evict_one(pool).is_some() {}
    }

    fn mark_if_evictable(&mut self, pool: &BlockPool, page: PageId) {
        let Some(entry) = self.entries.get_mut(&page) else {
            return;
        };
        if entry.evictable_since.is_none() && pool.refcount(page) == Ok(1) {
            let tick = self.next_tick;
            self.next_tick += 1;
            entry.evictable_since = Some(tick);
            self.lru.insert(tick, page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_with(pool: &mut BlockPool, num_tokens: usize) -> BlockTable {
        let mut table = BlockTable::new();
        table.append_slots(pool, num_tokens).unwrap();
        table
    }

    #[test]
    fn hash_is_chained_and_order_sensitive() {
        assert_ne!(hash_page(ROOT_HASH, &[1, 2]), hash_page(ROOT_HASH, &[2, 1]));
        assert_ne!(hash_page(ROOT_HASH, &[1, 2]), hash_page(7, &[1, 2]));
        assert_eq!(hash_page(5, &[3, 4]), hash_page(5, &[3, 4]));
    }

    #[test]
    fn register_find_share_then_evict_lru() {
        let mut pool = BlockPool::new(4, 2).unwrap();
        let mut cache = PrefixCache::new(2);
        let tokens = [10, 11, 12, 13, 14];
        let mut table = table_with(&mut pool, 5);
        let key0 = cache
            .insert(&mut pool, table.pages()[0], ROOT_HASH, &tokens[0..2])
            .unwrap()
            .unwrap();
        let key1 = cache
            .insert(&mut pool, table.pages()[1], key0, &tokens[2..4])
            .unwrap()
            .unwrap();
        assert_eq!(pool.refcount(table.pages()[0]), Ok(2));
        // Same content again is not registered twice.
        assert_eq!(
            cache.insert(&mut pool, table.pages()[0], ROOT_HASH, &tokens[0..2]),
            Ok(None)
        );
        let found = cache.find(&[10, 11, 12, 13, 99], 8);
        assert_eq!(found.pages, table.pages()[..2].to_vec());
        assert_eq!(found.keys, vec![key0, key1]);
        assert_eq!(cache.find(&[10, 11, 12, 99], 8).pages.len(), 1);
        assert_eq!(cache.find(&[10, 11, 12, 13], 1).pages.len(), 1);
        assert!(cache.find(&[11, 11], 8).pages.is_empty());
        let (first, second) = (table.pages()[0], table.pages()[1]);
        cache.release(&mut pool, &mut table).unwrap();
        assert_eq!(cache.num_evictable(), 2);
        assert_eq!(pool.num_free(), 2);
        // Tail first: the second page is the older evictable one.
        assert_eq!(
            cache.evictable_pages().collect::<Vec<_>>(),
            vec![second, first]
        );
        cache.acquire(&mut pool, &[first]).unwrap();
        assert_eq!(cache.num_evictable(), 1);
        assert!(cache.ensure_free(&mut pool, 3));
        assert!(!cache.contains(second));
        assert!(!cache.ensure_free(&mut pool, 4));
        // The orphaned chain stops at the evicted page.
        assert_eq!(cache.find(&tokens, 8).pages, vec![first]);
        cache.release_pages(&mut pool, &[first]).unwrap();
        cache.evict_all(&mut pool);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(cache.num_cached(), 0);
    }

    #[test]
    fn reused_parent_page_does_not_resurrect_stale_children() {
        let mut pool = BlockPool::new(4, 1).unwrap();
        let mut cache = PrefixCache::new(1);
        let mut table = table_with(&mut pool, 2);
        let key0 = cache
            .insert(&mut pool, table.pages()[0], ROOT_HASH, &[7])
            .unwrap()
            .unwrap();
        cache
            .insert(&mut pool, table.pages()[1], key0, &[8])
            .unwrap();
        cache.release(&mut pool, &mut table).unwrap();
        // Evict only the head (acquire the child to keep it), then re-register [7] elsewhere.
        let child = cache.find(&[7, 8], 2).pages[1];
        cache.acquire(&mut pool, &[child]).unwrap();
        cache.evict_one(&mut pool).unwrap();
        let mut other = table_with(&mut pool, 1);
        cache
            .insert(&mut pool, other.pages()[0], ROOT_HASH, &[7])
            .unwrap()
            .unwrap();
        // Same key chain, but the child's parent is a different registration: no hit.
        assert_eq!(cache.find(&[7, 8], 2).pages.len(), 1);
        cache.release(&mut pool, &mut other).unwrap();
        cache.release_pages(&mut pool, &[child]).unwrap();
    }

    #[test]
    fn insert_under_an_unknown_parent_is_refused() {
        let mut pool = BlockPool::new(2, 1).unwrap();
        let mut cache = PrefixCache::new(1);
        let table = table_with(&mut pool, 1);
        assert_eq!(
            cache.insert(&mut pool, table.pages()[0], 42, &[1]),
            Ok(None)
        );
        assert_eq!(
            cache.insert(&mut pool, table.pages()[0], ROOT_HASH, &[1, 2]),
            Ok(None)
        );
        assert_eq!(cache.num_cached(), 0);
    }

    #[test]
    fn events_mirror_the_registered_keys() {
        let mut pool = BlockPool::new(4, 2).unwrap();
        let mut cache = PrefixCache::new(2);
        let mut early = table_with(&mut pool, 2);
        cache
            .insert(&mut pool, early.pages()[0], ROOT_HASH, &[5, 6])
            .unwrap()
            .unwrap();
        cache.release(&mut pool, &mut early).unwrap();
        cache.record_events(true);
        let mut table = table_with(&mut pool, 4);
        let first = cache
            .insert(&mut pool, table.pages()[0], ROOT_HASH, &[1, 2])
            .unwrap()
            .unwrap();
        let second = cache
            .insert(&mut pool, table.pages()[1], first, &[3, 4])
            .unwrap()
            .unwrap();
        // Refused registrations report nothing.
        assert_eq!(
            cache.insert(&mut pool, table.pages()[1], first, &[3, 4]),
            Ok(None)
        );
        assert_eq!(
            cache.take_events(),
            vec![
                CacheEvent::Stored {
                    key: first,
                    parent: None,
                    tokens: vec![1, 2]
                },
                CacheEvent::Stored {
                    key: second,
                    parent: Some(first),
                    tokens: vec![3, 4]
                },
            ]
        );
        assert!(cache.take_events().is_empty());
        // Released tail first: the page registered before recording goes first (oldest), then
        // the chain's tail, then its head.
        cache.release(&mut pool, &mut table).unwrap();
        cache.evict_all(&mut pool);
        let early_key = hash_page(ROOT_HASH, &[5, 6]);
        assert_eq!(
            cache.take_events(),
            vec![
                CacheEvent::Removed { key: early_key },
                CacheEvent::Removed { key: second },
                CacheEvent::Removed { key: first },
            ]
        );
        cache.record_events(false);
        let table = table_with(&mut pool, 2);
        cache
            .insert(&mut pool, table.pages()[0], ROOT_HASH, &[1, 2])
            .unwrap()
            .unwrap();
        assert!(cache.take_events().is_empty());
        assert_eq!(cache.keys().collect::<Vec<_>>(), vec![first]);
    }
}
