//! Row tasks over a token-major output `y` (`[num_tokens, n]`): the matmul paths whose tasks
//! each cover some output rows for every token. [`by_row_tasks`] merges task-local blocks;
//! [`by_row_tasks_in_place`] gives each task a [`Columns`] window on `y` instead.

use rayon::prelude::*;

/// Rows per decode task for `num_rows` rows of work in one parallel region: about 16 tasks
/// per thread, at least 16 and at most 1024 rows, a multiple of 4.
pub fn decode_rows_per_task(num_rows: usize) -> usize {
    ((num_rows / (rayon::current_num_threads() * 16)).clamp(16, 1024) + 3) & !3
}

/// A task's window on a token-major output `y` (`[num_tokens, n]`): the columns `cols` of
/// every token row. The windows [`by_row_tasks_in_place`] hands out have disjoint columns, so
/// tasks on different threads never write the same element.
pub(crate) struct Columns<'a> {
    ptr: *mut f32,
    n: usize,
    num_tokens: usize,
    cols: std::ops::Range<usize>,
    _y: std::marker::PhantomData<&'a mut [f32]>,
}

impl<'a> Columns<'a> {
    /// All of `y` (`[y.len() / n, n]`) as one window.
    pub(crate) fn all(y: &'a mut [f32], n: usize) -> Columns<'a> {
        assert!(
            n > 0 && y.len().is_multiple_of(n),
            "y must be whole rows of n"
        );
        Columns {
            ptr: y.as_mut_ptr(),
            n,
            num_tokens: y.len() / n,
            cols: 0..n,
            _y: std::marker::PhantomData,
        }
    }

    /// Writes `values` to token `t`'s columns `col..col + values.len()`, which must lie in
    /// this window (else a panic).
    #[inline]
    pub(crate) fn put(&mut self, t: usize, col: usize, values: &[f32]) {
        assert!(
            t < self.num_tokens && col >= self.cols.start && col + values.len() <= self.cols.end,
            "a write outside the task's columns"
        );
        // SAFETY: the elements are inside `y` (checked above) and inside this window's
        // columns, which no other live window shares; `values` cannot alias `y`, which this
        // window borrows mutably.
        unsafe {
            std::ptr::copy_nonoverlapping(
                values.as_ptr(),
                self.ptr.add(t * self.n + col),
                values.len(),
            )
        }
    }
}

/// [`by_row_tasks`] without the merge: each task writes its dots straight into `y`
/// (`[num_tokens, n]`) through a window on its own columns.
pub(crate) fn by_row_tasks_in_place(
    n: usize,
    num_tokens: usize,
    rows_per_task: usize,
    y: &mut [f32],
    task: impl Fn(std::ops::Range<usize>, &mut Columns) + Sync,
) {
    assert_eq!(y.len(), n * num_tokens, "y must be [num_tokens, n]");
    /// `y`'s base pointer, shared by the tasks (each writes only its own columns).
    struct Base(*mut f32);
    impl Base {
        fn get(&self) -> *mut f32 {
            self.0
        }
    }
    // SAFETY: the tasks write disjoint columns through `Columns::put` only.
    unsafe impl Sync for Base {}
    let base = Base(y.as_mut_ptr());
    (0..n)
        .step_by(rows_per_task)
        .collect::<Vec<_>>()
        .into_par_iter()
        .for_each(|row_start| {
            let cols = row_start..(row_start + rows_per_task).min(n);
            let mut window = Columns {
                ptr: base.get(),
                n,
                num_tokens,
                cols: cols.clone(),
                _y: std::marker::PhantomData,
            };
            task(cols, &mut window);
        });
}

/// Runs `task(rows)` for consecutive ranges of `rows_per_task` of the `n` output rows in
/// parallel; each returns its dots token-major, `[num_tokens, rows]`, and the merge copies
/// one contiguous run per (token, task) into `y` (`[num_tokens, n]`). The matmul paths whose
/// tasks cover several tokens share it.
pub(crate) fn by_row_tasks(
    n: usize,
    num_tokens: usize,
    rows_per_task: usize,
    y: &mut [f32],
    task: impl Fn(std::ops::Range<usize>) -> Vec<f32> + Sync,
) {
    let tasks: Vec<(usize, Vec<f32>)> = (0..n)
        .step_by(rows_per_task)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|row_start| {
            let rows = row_start..(row_start + rows_per_task).min(n);
            (row_start, task(rows))
        })
        .collect();
    // Tokens outer, in parallel: each token's outputs are written contiguously.
    y.par_chunks_exact_mut(n)
        .enumerate()
        .with_min_len(16)
        .for_each(|(t, out)| {
            for (row_start, by_token) in &tasks {
                let rows = by_token.len() / num_tokens;
                out[*row_start..row_start + rows]
                    .copy_from_slice(&by_token[t * rows..(t + 1) * rows]);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task writes its own columns of every token, in place, in parallel; the result
    /// is the merge path's.
    #[test]
    fn in_place_tasks_write_their_columns_only() {
        let (n, num_tokens) = (37, 5);
        let value = |t: usize, r: usize| (t * 1000 + r) as f32;
        let mut merged = vec![f32::NAN; n * num_tokens];
        by_row_tasks(n, num_tokens, 8, &mut merged, |rows| {
            let mut local = Vec::new();
            for t in 0..num_tokens {
                local.extend(rows.clone().map(|r| value(t, r)));
            }
            local
        });
        let mut in_place = vec![f32::NAN; n * num_tokens];
        by_row_tasks_in_place(n, num_tokens, 8, &mut in_place, |rows, out| {
            for t in 0..num_tokens {
                let values: Vec<f32> = rows.clone().map(|r| value(t, r)).collect();
                out.put(t, rows.start, &values);
            }
        });
        assert_eq!(merged, in_place);
        assert!(in_place.iter().all(|v| !v.is_nan()));
    }

    #[test]
    #[should_panic(expected = "outside the task's columns")]
    fn a_write_past_the_window_panics() {
        let mut y = vec![0f32; 4 * 16];
        by_row_tasks_in_place(16, 4, 8, &mut y, |rows, out| {
            // One value past this task's last column.
            out.put(0, rows.end - 1, &[1.0, 2.0]);
        });
    }
}
