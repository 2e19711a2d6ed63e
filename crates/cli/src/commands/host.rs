//! What the benchmarks record about the machine they ran on.

/// The 1, 5 and 15-minute load averages (`/proc/loadavg`), or `unknown`.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
