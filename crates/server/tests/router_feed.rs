//! The engine loop's feed for a KV-aware router outside the server (NVIDIA Dynamo's worker):
//! with `WorkerOptions::kv_events`, the real engine's prefix-cache changes arrive per turn
//! (a prompt's full pages stored, chained, with their tokens), the load is published, and a
//! dropped receiver ends the feed without disturbing the serving.

use std::path::PathBuf;
use std::sync::Arc;

use pagoda_engine::{load_model, CacheEvent, Engine, EngineConfig, LoadOptions, ModelSource};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_ops::sampling::SamplingParams;
use pagoda_server::metrics::Metrics;
use pagoda_server::worker::{spawn_worker_with, Job, WorkerEvent, WorkerHandle, WorkerOptions};
use tokio::sync::mpsc::unbounded_channel;

fn engine() -> Option<Engine> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "skipping: {} is missing (scripts/fetch-model.sh)",
            path.display()
        );
        return None;
    }
    let options = LoadOptions::cpu(WeightPrecision::AsStored);
    let loaded = load_model(&ModelSource::Gguf(path), options, &mut |_, _| {}).unwrap();
    let config = EngineConfig {
        page_size: 16,
        num_pages: 64,
        max_batch_tokens: 256,
        max_context: 512,
        attention: AttentionPolicy::Auto,
        sampler: pagoda_ops::sampling::SamplerKind::DEFAULT,
        cuda_graphs: false,
        paged_decode: Default::default(),
        kv_types: Default::default(),
    };
    Some(Engine::with_prefix_caching(loaded.model, config, true).unwrap())
}

/// Submits `prompt` for 2 greedy tokens and waits for its end.
fn generate(handle: &WorkerHandle, prompt: &[u32]) {
    let (events, mut receiver) = unbounded_channel();
    handle
        .submit(Job {
            prompt: prompt.to_vec(),
            params: SamplingParams::greedy(),
            max_new_tokens: 2,
            stop_tokens: Vec::new(),
            top_logprobs: None,
            logit_bias: Vec::new(),
            constraint: None,
            sparse_attention: None,
            events,
        })
        .unwrap();
    while let Some(event) = receiver.blocking_recv() {
        match event {
            WorkerEvent::Token {
                finished: Some(_), ..
            } => return,
            WorkerEvent::Failed { message, .. } => panic!("{message}"),
            _ => {}
        }
    }
}

#[test]
fn the_loop_feeds_prefix_cache_changes_and_load_to_a_router() {
    let Some(engine) = engine() else {
        return;
    };
    let (sender, mut feed) = unbounded_channel();
    let options = WorkerOptions {
        kv_events: Some(sender),
    };
    let (handle, thread) =
        spawn_worker_with(engine, 2, 8, Arc::new(Metrics::default()), options).unwrap();
    // 40 tokens: two full pages of 16 and a partial one.
    let prompt: Vec<u32> = (0..40).map(|i| 100 + i * 7).collect();
    generate(&handle, &prompt);
    // The loop publishes its turn's cache changes and load after the turn's tokens: wait
    // (bounded) until both have come.
    let mut stored = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while stored.len() < 2 || handle.load().running != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{stored:?} {:?}",
            handle.load()
        );
        while let Ok(batch) = feed.try_recv() {
            stored.extend(batch);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Each full page in order, chained to the one before, with its tokens.
    let mut parent = None;
    for (page, event) in prompt.chunks_exact(16).zip(&stored) {
        let CacheEvent::Stored {
            key,
            parent: stored_parent,
            tokens,
        } = event
        else {
            panic!("{event:?}");
        };
        assert_eq!((*stored_parent, tokens.as_slice()), (parent, page));
        parent = Some(*key);
    }
    assert_eq!(stored.len(), 2, "{stored:?}");
    let load = handle.load();
    assert_eq!((load.running, load.waiting, load.pages_total), (0, 0, 64));

    // The same prompt again hits the cache: nothing new is stored.
    generate(&handle, &prompt);
    assert!(feed.try_recv().is_err());
    // A router that goes away ends the feed; the loop keeps serving.
    drop(feed);
    let other: Vec<u32> = (0..40).map(|i| 900 + i).collect();
    generate(&handle, &other);
    generate(&handle, &other);
    drop(handle);
    thread.join().unwrap();
}
