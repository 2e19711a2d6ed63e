//! Writing new tokens' K/V rows into the paged pool.

use pagoda_kv::Slot;

use crate::attention::validate::length;
use crate::attention::{AttentionError, KvLayout, KvPool};

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
    check_slots(layout, slots, k_new, v_new)?;
    for (token, slot) in slots.iter().enumerate() {
        let row = slot.physical_index(layout.page_size) * stride;
        let source = token * stride..(token + 1) * stride;
        k_pool[row..row + stride].copy_from_slice(&k_new[source.clone()]);
        v_pool[row..row + stride].copy_from_slice(&v_new[source]);
    }
    Ok(())
}

/// [`append_kv`] into pools of any [`KvType`](crate::attention::KvType): f32 pools take the
/// rows as they are, f16 pools round them, q8_0 pools quantize each head row's blocks (the
/// layout's `head_dim` must be a multiple of 32). Same checks, same all-or-nothing.
pub fn append_kv_pool(
    k_pool: &mut KvPool,
    v_pool: &mut KvPool,
    layout: &KvLayout,
    slots: &[Slot],
    k_new: &[f32],
    v_new: &[f32],
) -> Result<(), AttentionError> {
    if let (KvPool::F32(k_pool), KvPool::F32(v_pool)) = (&mut *k_pool, &mut *v_pool) {
        return append_kv(k_pool, v_pool, layout, slots, k_new, v_new);
    }
    for pool in [&*k_pool, &*v_pool] {
        pool.kv_type().check_head_dim(layout.head_dim)?;
        length(
            "KV pool [num_pages, page_size, num_kv_heads, head_dim]",
            layout.pool_len(),
            pool.len(),
        )?;
    }
    check_slots(layout, slots, k_new, v_new)?;
    let stride = layout.token_stride();
    for (token, slot) in slots.iter().enumerate() {
        let row = slot.physical_index(layout.page_size) * stride;
        let source = token * stride..(token + 1) * stride;
        k_pool.write(row, &k_new[source.clone()]);
        v_pool.write(row, &v_new[source]);
    }
    Ok(())
}

/// The new rows' lengths and every slot against the layout.
pub(crate) fn check_slots(
    layout: &KvLayout,
    slots: &[Slot],
    k_new: &[f32],
    v_new: &[f32],
) -> Result<(), AttentionError> {
    let stride = layout.token_stride();
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
    Ok(())
}
