//! Greedy tokens from a GGUF file through the CPU forward alone (no engine, server or CLI):
//! the aarch64 CI check (`scripts/test-aarch64.sh --ci`) cross-builds this, not the whole
//! CLI, and compares its NEON tokens under qemu with the native scalar ones.
//!
//!     greedy_tokens FILE.gguf [PROMPT_IDS (comma-separated)] [STEPS]
//!
//! Prints the generated token ids, one line. The weights stay as stored (the CLI's default);
//! the kernels are whatever the process selects (`PAGODA_CPU_KERNELS`, ...).

use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use pagoda_ops::sampling::argmax;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        return Err("usage: greedy_tokens FILE.gguf [PROMPT_IDS] [STEPS]".into());
    };
    // "The capital of France is" in the default model's vocabulary.
    let prompt: Vec<u32> = args
        .get(1)
        .map_or("504,3575,282,4649,314", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let steps: usize = args.get(2).map_or(Ok(16), |s| s.parse())?;
    let file = GgufFile::open(path)?;
    let model = Model::load(config_from_gguf(&file)?, &file, WeightPrecision::AsStored)?;
    let page_size = 16;
    let num_pages = (prompt.len() + steps).div_ceil(page_size);
    let mut pool = BlockPool::new(num_pages, page_size)?;
    let mut table = BlockTable::new();
    let mut kv = KvCache::new(
        model.config().num_layers,
        model.kv_layout(num_pages, page_size),
    );
    let (mut tokens, mut generated) = (prompt.clone(), Vec::new());
    let mut done = 0;
    while generated.len() < steps {
        let new = &tokens[done..];
        let slots = table.append_slots(&mut pool, new.len())?;
        let page_table = PageTable::from_block_tables(&[&table], &pool)?;
        let positions: Vec<u32> = (done as u32..tokens.len() as u32).collect();
        let batch = ForwardBatch {
            tokens: new,
            positions: &positions,
            slots: &slots,
            qo_indptr: &[0, new.len() as u32],
            page_table: &page_table,
            logits_for: &[new.len() - 1],
            sparse: &[],
        };
        let logits = model
            .forward(&batch, &mut kv, AttentionPolicy::Auto)?
            .logits;
        // The engine's greedy choice: the largest logit, the lowest id on ties.
        let next = argmax(&logits);
        done = tokens.len();
        tokens.push(next);
        generated.push(next.to_string());
    }
    println!("{}", generated.join(" "));
    Ok(())
}
