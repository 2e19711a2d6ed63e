//! Decode batches whose requests share leading pages, as the prefix cache shares them:
//! families behind one prefix, nested sub-families, requests sharing nothing, and twins whose
//! every page is shared (an empty own part). Used by the cascade plan's CPU tests and the
//! cascade kernels' GPU tests.

#![allow(dead_code)]

use pagoda_kv::PageTable;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Page lists and visible lengths of requests over pages of `page` tokens.
pub struct SharedBatch {
    pub lists: Vec<Vec<u32>>,
    pub seq_lens: Vec<usize>,
}

/// A shared-prefix batch: up to three families with prefixes of up to `max_prefix` pages,
/// each with up to two nested sub-families of up to `max_prefix / 2` more pages, requests
/// with 1..=`max_own` pages of their own (the last one partly filled), one in six sharing
/// nothing, and with `twins` two more requests holding the same pages, every one full. Page
/// ids are distinct and scattered below `num_pages`, a prime larger than the pages drawn.
pub fn shared_batch(
    rng: &mut ChaCha8Rng,
    batch: usize,
    (max_prefix, max_own): (usize, usize),
    (page, num_pages): (usize, u64),
    twins: bool,
) -> SharedBatch {
    let mut next_page = 0u64;
    let mut fresh = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                next_page += 1;
                assert!(next_page < num_pages, "more pages than ids");
                (next_page * 2_654_435_761 % num_pages) as u32
            })
            .collect()
    };
    let families: Vec<(Vec<u32>, Vec<Vec<u32>>)> = (0..rng.random_range(1..=3))
        .map(|_| {
            let prefix = fresh(rng.random_range(1..=max_prefix.max(1)));
            let subs = (0..rng.random_range(0..=2))
                .map(|_| fresh(rng.random_range(1..=(max_prefix / 2).max(1))))
                .collect();
            (prefix, subs)
        })
        .collect();
    let mut out = SharedBatch {
        lists: Vec::new(),
        seq_lens: Vec::new(),
    };
    for _ in 0..batch {
        let mut list = Vec::new();
        if rng.random_range(0..6) != 0 {
            let (prefix, subs) = &families[rng.random_range(0..families.len())];
            list.extend(prefix);
            if !subs.is_empty() && rng.random_range(0..3) != 0 {
                list.extend(&subs[rng.random_range(0..subs.len())]);
            }
        }
        list.extend(fresh(rng.random_range(1..=max_own.max(1))));
        out.seq_lens
            .push(list.len() * page - rng.random_range(0..page));
        out.lists.push(list);
    }
    if twins {
        let list = fresh(rng.random_range(1..=max_prefix.max(1)));
        for _ in 0..2 {
            out.seq_lens.push(list.len() * page);
            out.lists.push(list.clone());
        }
    }
    out
}

impl SharedBatch {
    /// The CSR page table (every request visible from its first token).
    pub fn table(&self, page: usize) -> PageTable {
        let mut t = PageTable {
            indptr: vec![0],
            ..PageTable::default()
        };
        for (pages, &len) in self.lists.iter().zip(&self.seq_lens) {
            t.indices.extend(pages);
            t.indptr.push(t.indices.len() as u32);
            t.last_page_len.push(((len - 1) % page + 1) as u32);
            t.first_page_offset.push(0);
            t.seq_lens.push(len as u32);
            t.rope_offsets.push(len as u32);
        }
        t
    }
}
