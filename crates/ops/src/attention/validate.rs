//! Boundary checks shared by the attention entry points. Kernels run only after these pass,
//! so they index without re-checking.

use super::{AttentionError, KvLayout, PagedKv};

/// `actual == expected`, or a [`AttentionError::Length`] naming `what`.
pub(crate) fn length(
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<(), AttentionError> {
    if expected == actual {
        Ok(())
    } else {
        Err(AttentionError::Length {
            what,
            expected,
            actual,
        })
    }
}

/// Checks the head geometry and returns `n_rep = num_q_heads / num_kv_heads`.
pub(crate) fn geometry(layout: &KvLayout, num_q_heads: usize) -> Result<usize, AttentionError> {
    if layout.page_size == 0 || layout.num_kv_heads == 0 || layout.head_dim == 0 {
        return Err(AttentionError::Geometry(format!(
            "page_size {}, num_kv_heads {} and head_dim {} must all be >= 1",
            layout.page_size, layout.num_kv_heads, layout.head_dim
        )));
    }
    let n_rep = num_q_heads / layout.num_kv_heads;
    if n_rep == 0 || n_rep * layout.num_kv_heads != num_q_heads {
        return Err(AttentionError::Geometry(format!(
            "num_q_heads {num_q_heads} is not a positive multiple of num_kv_heads {}",
            layout.num_kv_heads
        )));
    }
    Ok(n_rep)
}

/// Checks the pool sizes and the page table against the layout; returns `n_rep`.
pub(crate) fn paged_kv(kv: &PagedKv<'_>, num_q_heads: usize) -> Result<usize, AttentionError> {
    let n_rep = geometry(&kv.layout, num_q_heads)?;
    kv.k_pool.kv_type().check_head_dim(kv.layout.head_dim)?;
    kv.v_pool.kv_type().check_head_dim(kv.layout.head_dim)?;
    let pool_len = kv.layout.pool_len();
    length(
        "k_pool [num_pages, page_size, num_kv_heads, head_dim]",
        pool_len,
        kv.k_pool.len(),
    )?;
    length(
        "v_pool [num_pages, page_size, num_kv_heads, head_dim]",
        pool_len,
        kv.v_pool.len(),
    )?;
    kv.page_table
        .validate(kv.layout.num_pages, kv.layout.page_size)?;
    Ok(n_rep)
}

/// Checks an indptr: `num_rows + 1` entries, starts at 0, non-decreasing, ends at `total`.
pub(crate) fn indptr(
    what: &'static str,
    indptr: &[u32],
    num_rows: usize,
    total: usize,
) -> Result<(), AttentionError> {
    let fail = |reason: String| Err(AttentionError::Indptr { what, reason });
    if indptr.len() != num_rows + 1 {
        return fail(format!(
            "{} entries, expected {}",
            indptr.len(),
            num_rows + 1
        ));
    }
    if indptr[0] != 0 {
        return fail(format!("starts at {}, must start at 0", indptr[0]));
    }
    if let Some(row) = (0..num_rows).find(|&row| indptr[row + 1] < indptr[row]) {
        return fail(format!(
            "decreases at row {row}: {} > {}",
            indptr[row],
            indptr[row + 1]
        ));
    }
    if indptr[num_rows] as usize != total {
        return fail(format!("ends at {}, expected {total}", indptr[num_rows]));
    }
    Ok(())
}

/// Checks `qo_indptr` against the page table: `B + 1` entries ending at `num_tokens`, and no
/// request with more queries than visible tokens.
pub(crate) fn query_indptr(
    qo_indptr: &[u32],
    seq_lens: &[u32],
    num_tokens: usize,
) -> Result<(), AttentionError> {
    indptr("qo_indptr", qo_indptr, seq_lens.len(), num_tokens)?;
    for (request, &seq_len) in seq_lens.iter().enumerate() {
        let num_queries = (qo_indptr[request + 1] - qo_indptr[request]) as usize;
        if num_queries > seq_len as usize {
            return Err(AttentionError::QueriesExceedSequence {
                request,
                num_queries,
                seq_len: seq_len as usize,
            });
        }
    }
    Ok(())
}

/// Checks that `qo_indptr` is the decode shape `[0, 1, ..., B]`: one query per request.
pub(crate) fn decode_indptr(qo_indptr: &[u32], num_requests: usize) -> Result<(), AttentionError> {
    if qo_indptr.len() != num_requests + 1 || qo_indptr[0] != 0 {
        return indptr("qo_indptr", qo_indptr, num_requests, num_requests);
    }
    for request in 0..num_requests {
        let num_queries = qo_indptr[request + 1] as i64 - qo_indptr[request] as i64;
        if num_queries != 1 {
            return Err(AttentionError::NotDecode {
                request,
                num_queries: num_queries.max(0) as usize,
            });
        }
    }
    Ok(())
}
