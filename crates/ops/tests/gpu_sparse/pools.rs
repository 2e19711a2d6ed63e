//! The host side of a sparse-decode GPU test: one layer's pools as the host holds them and
//! the CPU summaries folded from the same rows.

use super::common::{random_vec, round, TestFloat};
use pagoda_kv::{PageId, Slot};
use pagoda_ops::attention::{KeySummaries, KvLayout, KvSlice};
use pagoda_ops::cuda::PoolLayout;
use rand_chacha::ChaCha8Rng;

/// One layer's pools on both sides: host values (rounded through `T`) and the CPU summaries.
pub struct Pools {
    pub layout: PoolLayout,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub summaries: KeySummaries,
}

impl Pools {
    pub fn new(layout: PoolLayout) -> Pools {
        let cpu = cpu_layout(&layout);
        Pools {
            layout,
            k: vec![0.0; layout.pool_len()],
            v: vec![0.0; layout.pool_len()],
            summaries: KeySummaries::new(&cpu),
        }
    }

    /// Writes random rows (rounded through `T`) at `slots` (`None`: padding) and folds them
    /// into the CPU summaries.
    pub fn write<T: TestFloat>(&mut self, rng: &mut ChaCha8Rng, slots: &[Option<Slot>]) {
        let stride = self.layout.token_stride();
        let written: Vec<Slot> = slots.iter().flatten().copied().collect();
        for slot in &written {
            let at = (slot.page.index() * self.layout.page_size + slot.offset as usize) * stride;
            let k = round::<T>(&random_vec(rng, stride, 1.0));
            let v = round::<T>(&random_vec(rng, stride, 1.0));
            self.k[at..at + stride].copy_from_slice(&k);
            self.v[at..at + stride].copy_from_slice(&v);
        }
        self.fold(&written);
    }

    /// Copies page `from`'s first `rows` rows into page `to` (written as one step).
    pub fn copy_page(&mut self, from: usize, to: usize, rows: usize) -> Vec<Option<Slot>> {
        let page = self.layout.page_size * self.layout.token_stride();
        let len = rows * self.layout.token_stride();
        let (k, v) = (
            self.k[from * page..from * page + len].to_vec(),
            self.v[from * page..from * page + len].to_vec(),
        );
        self.k[to * page..to * page + len].copy_from_slice(&k);
        self.v[to * page..to * page + len].copy_from_slice(&v);
        let slots: Vec<Slot> = (0..rows as u32)
            .map(|offset| Slot {
                page: PageId(to as u32),
                offset,
            })
            .collect();
        self.fold(&slots);
        slots.into_iter().map(Some).collect()
    }

    fn fold(&mut self, slots: &[Slot]) {
        let cpu = cpu_layout(&self.layout);
        self.summaries
            .update(KvSlice::F32(&self.k), &cpu, slots)
            .unwrap();
    }
}

pub fn cpu_layout(layout: &PoolLayout) -> KvLayout {
    KvLayout {
        num_pages: layout.num_pages,
        page_size: layout.page_size,
        num_kv_heads: layout.num_kv_heads,
        head_dim: layout.head_dim,
    }
}

pub fn device_slots(slots: &[Option<Slot>], page_size: usize) -> Vec<i32> {
    slots
        .iter()
        .map(|slot| match slot {
            Some(slot) => (slot.page.index() * page_size + slot.offset as usize) as i32,
            None => -1,
        })
        .collect()
}
