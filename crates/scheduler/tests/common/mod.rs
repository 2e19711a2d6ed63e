//! A fake model and invariant checks shared by the scheduler tests.
//!
//! The fake model's next token is a hash of the whole sequence so far, so the tokens a request
//! generates are fully determined by its prompt: recomputation after preemption, prefix hits
//! and batching must not change them. A shadow KV pool records which (position, token) each
//! slot holds, written when a plan is run, so every step can check that all the KV a
//! sequence attends to is its own tokens at the right positions.

#![allow(dead_code)]

use std::collections::HashMap;

use pagoda_scheduler::{PageId, SampledToken, Scheduler, SchedulerConfig, StepPlan};

/// The fake model: next token after `tokens`.
pub fn next_token(tokens: &[u32]) -> u32 {
    let mut state = 0xcbf2_9ce4_8422_2325u64;
    for &token in tokens {
        state = (state ^ u64::from(token)).wrapping_mul(0x0100_0000_01b3);
    }
    (state >> 40) as u32 % 1000
}

/// Whether the fake model calls `token` a stop token.
pub fn is_stop(token: u32) -> bool {
    token.is_multiple_of(97)
}

/// What a request generates with no scheduler at all (the oracle).
pub fn reference_generation(prompt: &[u32], max_new_tokens: usize, stops: bool) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    let mut generated = Vec::new();
    while generated.len() < max_new_tokens {
        let token = next_token(&tokens);
        tokens.push(token);
        generated.push(token);
        if stops && is_stop(token) {
            break;
        }
    }
    generated
}

/// The shadow KV pool: slot -> (position, token) written there.
#[derive(Default)]
pub struct ShadowKv {
    rows: HashMap<(PageId, u32), (usize, u32)>,
}

impl ShadowKv {
    /// Checks the plan against the scheduler and the shadow pool, then "runs" it: writes its
    /// slots. Returns the sampled tokens for `postprocess`.
    pub fn run(
        &mut self,
        scheduler: &Scheduler,
        plan: &StepPlan,
        stops: bool,
    ) -> Vec<SampledToken> {
        let page_size = scheduler.config().page_size;
        assert!(
            plan.num_tokens() <= scheduler.config().max_batch_tokens,
            "budget exceeded"
        );
        plan.page_table().expect("plan's page table validates");
        let mut seen_slots = std::collections::HashSet::new();
        let mut sampled = Vec::new();
        for row in &plan.sequences {
            let own = scheduler.tokens(row.id).expect("scheduled request is live");
            assert_eq!(scheduler.pages_of(row.id), Some(row.pages.as_slice()));
            // With a draft, the chunk runs past the sequence's own tokens into the guesses.
            let mut tokens = own.to_vec();
            tokens.extend(&row.tokens[row.tokens.len() - row.draft..]);
            if row.draft > 0 {
                assert!(row.samples, "a drafted row samples");
                assert_eq!(
                    tokens.len(),
                    row.positions.end,
                    "a draft follows the last token"
                );
            }
            assert_eq!(row.tokens, tokens[row.positions.clone()]);
            assert_eq!(row.slots.len(), row.positions.len());
            // Everything before the chunk is already in the sequence's pages.
            for position in 0..row.positions.start {
                let page = row.pages[position / page_size];
                let offset = (position % page_size) as u32;
                assert_eq!(
                    self.rows.get(&(page, offset)),
                    Some(&(position, tokens[position])),
                    "request {}: KV of position {position} is not its token",
                    row.id
                );
            }
            if row.prefix_hit_tokens > 0 {
                assert_eq!(row.prefix_hit_tokens % page_size, 0, "partial page shared");
                assert!(
                    row.prefix_hit_tokens < tokens.len(),
                    "last token not recomputed"
                );
                for (index, page) in row.pages[..row.prefix_hit_tokens / page_size]
                    .iter()
                    .enumerate()
                {
                    let cached = scheduler.prefix_cache().page_tokens(*page);
                    assert_eq!(
                        cached,
                        Some(&tokens[index * page_size..(index + 1) * page_size])
                    );
                }
            }
            for (position, slot) in row.positions.clone().zip(&row.slots) {
                assert!(seen_slots.insert(*slot), "slot written twice in one step");
                assert_eq!(slot.page, row.pages[position / page_size]);
                assert_eq!(
                    scheduler.pool().refcount(slot.page),
                    Ok(1),
                    "write into a shared page"
                );
                self.rows
                    .insert((slot.page, slot.offset), (position, tokens[position]));
            }
            if row.samples {
                // Verification: each guess is kept while it is the model's own next token and
                // no stop came first; the first other token is emitted.
                let mut context = own.to_vec();
                let draft = &row.tokens[row.tokens.len() - row.draft..];
                let mut accepted = 0;
                let token = loop {
                    let token = next_token(&context);
                    let stop = stops && is_stop(token);
                    if stop || accepted == draft.len() || draft[accepted] != token {
                        break token;
                    }
                    context.push(token);
                    accepted += 1;
                };
                sampled.push(SampledToken {
                    id: row.id,
                    token,
                    stop: stops && is_stop(token),
                    accepted,
                });
            }
        }
        sampled
    }
}

/// Every page in the prefix cache holds, in the shadow pool, exactly its own tokens at
/// their positions: no page with a rejected guess's KV was registered.
pub fn check_cache(shadow: &ShadowKv, scheduler: &Scheduler) {
    let page_size = scheduler.config().page_size;
    let cache = scheduler.prefix_cache();
    for page in cache.cached_pages() {
        let tokens = cache.page_tokens(page).expect("cached page has tokens");
        for (offset, &token) in tokens.iter().enumerate() {
            let (position, written) = shadow.rows[&(page, offset as u32)];
            assert_eq!(
                (position % page_size, written),
                (offset, token),
                "{page} row {offset}: the cache holds KV of another token"
            );
        }
    }
}

/// A proposer for the tests: `len` guesses after `tokens`, the first `right` of them the
/// model's own next tokens and the rest wrong.
pub fn draft(tokens: &[u32], len: usize, right: usize) -> Vec<u32> {
    let mut context = tokens.to_vec();
    let mut guesses = Vec::with_capacity(len);
    for index in 0..len {
        let token = next_token(&context);
        let guess = if index < right {
            token
        } else {
            (token + 1) % 1000
        };
        context.push(guess);
        guesses.push(guess);
    }
    guesses
}

/// Refcount of every page == owners (running sequences + the cache); free pages owned by
/// nobody; the stats add up.
pub fn check_pool(scheduler: &Scheduler) {
    let pool = scheduler.pool();
    let cache = scheduler.prefix_cache();
    let mut owners = vec![0u32; pool.num_pages()];
    for id in scheduler.running_ids() {
        for page in scheduler.pages_of(id).unwrap() {
            owners[page.index()] += 1;
        }
    }
    for page in cache.cached_pages() {
        owners[page.index()] += 1;
    }
    for (index, &count) in owners.iter().enumerate() {
        let page = PageId(index as u32);
        assert_eq!(pool.refcount(page), Ok(count), "{page}: refcount != owners");
        assert_eq!(pool.is_free(page), count == 0);
    }
    for page in cache.evictable_pages() {
        assert_eq!(
            pool.refcount(page),
            Ok(1),
            "{page}: evictable but held by a sequence"
        );
    }
    let stats = scheduler.stats();
    assert_eq!(
        stats.pages_free + stats.pages_used + stats.pages_evictable,
        stats.pages_total
    );
    assert_eq!(stats.num_running, scheduler.running_ids().len());
}

/// A small config.
pub fn config(page_size: usize, num_pages: usize, budget: usize, caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        prefix_caching: caching,
        ..SchedulerConfig::new(page_size, num_pages, budget)
    }
}
