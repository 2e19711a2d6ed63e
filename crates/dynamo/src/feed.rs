//! What Dynamo's KV router learns from this worker: the prefix cache's changes as KV events
//! (pagoda's 16-token pages are Dynamo's blocks; a page's chained key is the block hash, and
//! Dynamo's own hash of its tokens the `tokens_hash` the router matches prompts against) and
//! the load (pages in use), published from two threads fed by pagoda's engine loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dynamo_backend_common::{ComponentSnapshot, KvEventPublisher, SnapshotPublisher};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
};
use pagoda_engine::CacheEvent;
use pagoda_server::worker::LoadGauge;
use tokio::sync::mpsc::UnboundedReceiver;

/// How often the load is published (Dynamo debounces unchanged values itself).
const LOAD_PERIOD: Duration = Duration::from_millis(100);

/// Dynamo's event for one of pagoda's cache events; `event_id` numbers them in order.
pub fn to_dynamo(event: CacheEvent, event_id: u64, page_size: u32) -> KvCacheEvent {
    let data = match event {
        CacheEvent::Stored {
            key,
            parent,
            tokens,
        } => {
            let tokens_hash =
                compute_block_hash_for_seq(&tokens, page_size, BlockHashOptions::default());
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: tokens_hash
                    .into_iter()
                    .map(|tokens_hash| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(key),
                        tokens_hash,
                        mm_extra_info: None,
                    })
                    .collect(),
            })
        }
        CacheEvent::Removed { key } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalSequenceBlockHash(key)],
        }),
    };
    KvCacheEvent {
        event_id,
        data,
        dp_rank: 0,
    }
}

/// Publishes the loop's cache events until the loop (or Dynamo's publisher) goes away.
pub fn forward_kv_events(
    mut feed: UnboundedReceiver<Vec<CacheEvent>>,
    publisher: Arc<KvEventPublisher>,
    page_size: u32,
) {
    let mut next_id = 0u64;
    while let Some(batch) = feed.blocking_recv() {
        let events = batch
            .into_iter()
            .map(|event| {
                next_id += 1;
                to_dynamo(event, next_id - 1, page_size)
            })
            .collect();
        if publisher.publish_batch(events).is_err() {
            tracing::warn!("Dynamo's KV event publisher closed; KV events stop");
            return;
        }
    }
}

/// Publishes the loop's load every [`LOAD_PERIOD`] until `stop` is set.
pub fn publish_load(gauge: LoadGauge, publisher: Arc<SnapshotPublisher>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let load = gauge.get();
        let total = load.pages_total.max(1);
        publisher.publish(
            0,
            ComponentSnapshot {
                kv_used_blocks: load.pages_used as u64,
                kv_total_blocks: load.pages_total as u64,
                gpu_cache_usage: load.pages_used as f32 / total as f32,
                kv_cache_hit_rate: None,
                dp_rank: 0,
            },
        );
        std::thread::sleep(LOAD_PERIOD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_page_is_one_block_with_dynamos_token_hash() {
        let tokens: Vec<u32> = (0..16).collect();
        let event = to_dynamo(
            CacheEvent::Stored {
                key: 7,
                parent: Some(3),
                tokens: tokens.clone(),
            },
            5,
            16,
        );
        let expected = compute_block_hash_for_seq(&tokens, 16, BlockHashOptions::default());
        assert_eq!(expected.len(), 1);
        let KvCacheEventData::Stored(store) = &event.data else {
            panic!("{event:?}");
        };
        assert_eq!(event.event_id, 5);
        assert_eq!(store.parent_hash, Some(ExternalSequenceBlockHash(3)));
        assert_eq!(store.blocks.len(), 1);
        assert_eq!(store.blocks[0].block_hash, ExternalSequenceBlockHash(7));
        assert_eq!(store.blocks[0].tokens_hash, expected[0]);
        let first = to_dynamo(
            CacheEvent::Stored {
                key: 3,
                parent: None,
                tokens,
            },
            4,
            16,
        );
        let KvCacheEventData::Stored(store) = &first.data else {
            panic!("{first:?}");
        };
        assert_eq!(store.parent_hash, None);
    }

    #[test]
    fn a_removed_page_names_its_key() {
        let event = to_dynamo(CacheEvent::Removed { key: 9 }, 0, 16);
        assert_eq!(
            event.data,
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: vec![ExternalSequenceBlockHash(9)]
            })
        );
    }
}
