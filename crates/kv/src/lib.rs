//! Paged KV-cache bookkeeping: pure logic over integers, no tensors, no device.
//!
//! OWNED BY THE KV HELPER.
