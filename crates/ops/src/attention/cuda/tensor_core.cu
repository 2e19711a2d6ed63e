// Tensor-core and async-copy building blocks (compute capability 8.0+), prepended to the
// kernels that stream K/V through shared memory (the paged decodes, the streaming prefill).

// cp.async of 16 bytes into shared memory, zero-filled unless `valid` (the source must be
// 16-byte aligned even then).
PAGODA_DEVICE void cp_async16(void* shared_dst, const void* global_src, bool valid) {
    const unsigned int dst = (unsigned int)__cvta_generic_to_shared(shared_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src),
                 "r"(valid ? 16 : 0));
}
// The same, with a hint that the whole 128-byte line will be read (neighbouring threads copy
// the rest of it).
PAGODA_DEVICE void cp_async16_line(void* shared_dst, const void* global_src, bool valid) {
    const unsigned int dst = (unsigned int)__cvta_generic_to_shared(shared_dst);
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src),
                 "r"(valid ? 16 : 0));
}
PAGODA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> PAGODA_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

PAGODA_DEVICE unsigned int shared_address(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}
// Four 8x8 b16 matrices from shared memory: lane l gives row l % 8 of matrix l / 8.
PAGODA_DEVICE void ldmatrix_x4(unsigned int addr, unsigned int (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// The same, each matrix transposed.
PAGODA_DEVICE void ldmatrix_x4_trans(unsigned int addr, unsigned int (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// d += a b: mma.sync m16n8k16, bf16 operands, f32 accumulators; a is the A fragment's four
// registers (rows g and g + 8, columns 2 (l % 4) + {0, 1} and + 8).
PAGODA_DEVICE void mma_bf16(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                            unsigned int a3, unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
PAGODA_DEVICE unsigned int pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
}
// 2^x on the special-function unit (flushes denormals; 2^-inf = 0).
PAGODA_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
