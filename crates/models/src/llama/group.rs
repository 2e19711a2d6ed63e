//! A tensor-parallel group in one process: the leader rank is the `Model` the engine holds;
//! ranks `1..world` are worker threads, each with its shard, its own KV cache and its own
//! rayon pool. Every forward of the leader hands the batch to the workers first, so all ranks
//! run the same step and meet in the same collectives; each gathers the logits, and the
//! leader returns the whole rows (`pagoda generate/bench/serve --device cpu -tp N`).
//!
//! Each worker has its own pool (`threads / world` threads): a rank blocked in a collective
//! then never holds a thread another rank's kernels wait for.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use pagoda_kv::{PageTable, Slot};
use pagoda_ops::attention::{CascadeRule, KvType};
use pagoda_ops::collective::{Communicator, LocalGroup};

use super::{step, AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use crate::config::ModelConfig;
use crate::weights::{LoadError, TensorSource};

/// One step for a worker: the batch (owned) and what the leader's call was.
struct Job {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<Slot>,
    qo_indptr: Vec<u32>,
    page_table: PageTable,
    logits_for: Vec<usize>,
    policy: AttentionPolicy,
    head: step::Head,
    /// The leader's KV cache shape: `(num_pages, page_size, k_type, v_type)`.
    kv: (usize, usize, KvType, KvType),
    split_kv_chunk_tokens: usize,
    cascade: Option<CascadeRule>,
}

/// The leader's handles on its worker ranks.
pub(super) struct Workers {
    jobs: Vec<Sender<Job>>,
    replies: Mutex<Receiver<Result<(), String>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Hands `batch` to every worker.
    pub(super) fn dispatch(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &KvCache,
        policy: AttentionPolicy,
        head: step::Head,
        split_kv_chunk_tokens: usize,
        cascade: Option<CascadeRule>,
    ) {
        let (k_type, v_type) = kv.types();
        for jobs in &self.jobs {
            let job = Job {
                tokens: batch.tokens.to_vec(),
                positions: batch.positions.to_vec(),
                slots: batch.slots.to_vec(),
                qo_indptr: batch.qo_indptr.to_vec(),
                page_table: batch.page_table.clone(),
                logits_for: batch.logits_for.to_vec(),
                policy,
                head,
                kv: (kv.layout.num_pages, kv.layout.page_size, k_type, v_type),
                split_kv_chunk_tokens,
                cascade,
            };
            // A worker that is gone is reported by `collect`.
            let _ = jobs.send(job);
        }
    }

    /// Waits for every worker's step; the first error, if any.
    pub(super) fn collect(&self) -> Result<(), String> {
        let replies = self.replies.lock().map_err(|_| "a worker rank panicked")?;
        let mut outcome = Ok(());
        for _ in &self.jobs {
            let reply = replies
                .recv()
                .unwrap_or_else(|_| Err("a worker rank stopped".to_string()));
            if outcome.is_ok() {
                outcome = reply;
            }
        }
        outcome
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.jobs.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Model {
    /// `config` split over `world` ranks of one process ([`LocalGroup`]): the returned model
    /// is rank 0, and its [`Model::forward`] runs every rank and returns the whole logits.
    /// One rank is [`Model::load`].
    pub fn load_tensor_parallel(
        config: ModelConfig,
        source: &dyn TensorSource,
        precision: WeightPrecision,
        world: usize,
    ) -> Result<Model, LoadError> {
        if world <= 1 {
            return Model::load(config, source, precision);
        }
        let mut groups = LocalGroup::new(world).into_iter();
        let leader_group = groups.next().expect("a group has rank 0");
        let mut leader =
            Model::load_shard(config.clone(), source, precision, Arc::new(leader_group))?;
        let pool_threads = (super::global_pool_threads() / world).max(1);
        let (reply_to, replies) = channel();
        let (mut jobs, mut threads) = (Vec::new(), Vec::new());
        for group in groups {
            let rank = group.rank();
            let model = Model::load_shard(config.clone(), source, precision, Arc::new(group))?;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(pool_threads)
                .thread_name(move |i| format!("pagoda-rank{rank}-{i}"))
                .build()
                .map_err(|e| LoadError(format!("rank {rank}'s thread pool: {e}")))?;
            let (job_to, job_from) = channel();
            let reply_to = reply_to.clone();
            let thread = std::thread::Builder::new()
                .name(format!("pagoda-rank{rank}"))
                .spawn(move || worker(model, pool, job_from, reply_to))
                .map_err(|e| LoadError(format!("rank {rank}'s thread: {e}")))?;
            jobs.push(job_to);
            threads.push(thread);
        }
        let parallel = leader.parallel.as_mut().expect("a shard of several ranks");
        parallel.gather_logits = true;
        parallel.workers = Some(Workers {
            jobs,
            replies: Mutex::new(replies),
            threads,
        });
        Ok(leader)
    }
}

/// A worker rank's loop: one step per job, until the leader drops its handles.
fn worker(
    mut model: Model,
    pool: rayon::ThreadPool,
    jobs: Receiver<Job>,
    replies: Sender<Result<(), String>>,
) {
    if let Some(parallel) = model.parallel.as_mut() {
        parallel.gather_logits = true;
    }
    let mut kv: Option<KvCache> = None;
    while let Ok(job) = jobs.recv() {
        let (num_pages, page_size, k_type, v_type) = job.kv;
        let fits = kv.as_ref().is_some_and(|kv| {
            (kv.layout.num_pages, kv.layout.page_size, kv.types())
                == (num_pages, page_size, (k_type, v_type))
        });
        if !fits {
            kv = match model.new_kv_cache(num_pages, page_size, k_type, v_type) {
                Ok(cache) => Some(cache),
                Err(error) => {
                    let _ = replies.send(Err(error.to_string()));
                    continue;
                }
            };
        }
        let Some(cache) = kv.as_mut() else { continue };
        model.set_split_kv_chunk_tokens(job.split_kv_chunk_tokens);
        model.set_cascade(job.cascade);
        let batch = ForwardBatch {
            tokens: &job.tokens,
            positions: &job.positions,
            slots: &job.slots,
            qo_indptr: &job.qo_indptr,
            page_table: &job.page_table,
            logits_for: &job.logits_for,
            sparse: &[],
        };
        let model = &model;
        let outcome = pool.install(|| model.run(&batch, cache, job.policy, job.head));
        if replies
            .send(outcome.map(|_| ()).map_err(|e| e.to_string()))
            .is_err()
        {
            return;
        }
    }
}
