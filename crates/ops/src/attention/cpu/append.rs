//! Writing new tokens' K/V rows into the paged pool.

use pagoda_kv::Slot;

use crate::attention::validate::length;
use crate::attention::{AttentionError, KvLayout};

/// Writes token `i` of `k_new`/`v_new` (`[T, num_kv_heads, head_dim]` each) into row
/// `slots[i]` of `k_pool`/`v_pool` (`[num_pages, page_size, num_kv_heads, head_dim]`), in
/// place. Nothing is written unless every slot is inside the pool and every length matches.
/// If two slots are equal, the later token wins.
pub fn append_kv(
    k_pool: &mut [f32],
    v_pool: &mut [f32],
    layout: &KvLayout,
    slots: &[Slot],
    k_new: &[f32],
    v_new: &[f32],
) -> Result<(), AttentionError> {
    let stride = layout.token_stride();
    length(
        "k_pool [num_pages, page_size, num_kv_heads, head_dim]",
        layout.pool_len(),
        k_pool.len(),
    )?;
    length(
        "v_pool [num_pages, page_size, num_kv_heads, head_dim]",
        layout.pool_len(),
        v_pool.len(),
    )?;
    length(
        "k_new [T, num_kv_heads, head_dim]",
        slots.len() * stride,
        k_new.len(),
    )?;
    length(
        "v_new [T, num_kv_heads, head_dim]",
        slots.len() * stride,
        v_new.len(),
    )?;
    for (index, slot) in slots.iter().enumerate() {
        let reason = if slot.page.index() >= layout.num_pages {
            format!("page >= num_pages {}", layout.num_pages)
        } else if slot.offset as usize >= layout.page_size {
            format!("offset >= page_size {}", layout.page_size)
        } else {
            continue;
        };
        return Err(AttentionError::SlotOutOfRange {
            index,
            page: slot.page.0,
            offset: slot.offset,
            reason,
        });
    }
    for (token, slot) in slots.iter().enumerate() {
        let row = slot.physical_index(layout.page_size) * stride;
        let source = token * stride..(token + 1) * stride;
        k_pool[row..row + stride].copy_from_slice(&k_new[source.clone()]);
        v_pool[row..row + stride].copy_from_slice(&v_new[source]);
    }
    Ok(())
}
