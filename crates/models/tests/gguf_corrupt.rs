//! Malformed GGUF files: every one must give an `Err` naming the file and what is wrong,
//! never a panic and never a huge allocation.

use std::path::Path;

use pagoda_models::formats::gguf::{GgufFile, MetadataValue};
use pagoda_tensor::GgmlType;

const LABEL: &str = "corrupt-test.gguf";

/// Writes GGUF bytes by hand, so tests can put anything anywhere.
#[derive(Default)]
struct Builder {
    bytes: Vec<u8>,
}

impl Builder {
    fn header(version: u32, tensor_count: u64, metadata_count: u64) -> Builder {
        let mut builder = Builder::default();
        builder
            .raw(b"GGUF")
            .u32(version)
            .u64(tensor_count)
            .u64(metadata_count);
        builder
    }
    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(bytes);
        self
    }
    fn u32(&mut self, value: u32) -> &mut Self {
        self.raw(&value.to_le_bytes())
    }
    fn u64(&mut self, value: u64) -> &mut Self {
        self.raw(&value.to_le_bytes())
    }
    fn string(&mut self, text: &[u8]) -> &mut Self {
        self.u64(text.len() as u64).raw(text)
    }
    /// A metadata entry with a u32 value.
    fn kv_u32(&mut self, key: &str, value: u32) -> &mut Self {
        self.string(key.as_bytes()).u32(4).u32(value)
    }
    fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.string(name.as_bytes()).u32(dims.len() as u32);
        for &dim in dims {
            self.u64(dim);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads with zeros to a multiple of `alignment`, then appends `data_len` bytes.
    fn data(&mut self, alignment: usize, data_len: usize) -> &mut Self {
        let padded = self.bytes.len().next_multiple_of(alignment);
        self.bytes.resize(padded + data_len, 0xAB);
        self
    }
    fn build(&self) -> Vec<u8> {
        self.bytes.clone()
    }
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, String> {
    GgufFile::from_bytes(LABEL, bytes).map_err(|e| e.to_string())
}

/// Asserts the bytes are rejected with a message naming the file and containing `needle`.
fn assert_rejected(bytes: Vec<u8>, needle: &str) {
    match parse(bytes) {
        Ok(file) => panic!("expected an error containing {needle:?}, parsed {file:?}"),
        Err(message) => {
            assert!(message.starts_with(LABEL), "no file name in: {message}");
            assert!(
                message.contains(needle),
                "expected {needle:?} in: {message}"
            );
        }
    }
}

/// A valid file: one metadata entry and one F32 tensor of 8 values.
fn valid_file() -> Builder {
    let mut builder = Builder::header(3, 1, 1);
    builder
        .kv_u32("llama.block_count", 2)
        .tensor_info("a", &[8], 0, 0)
        .data(32, 32);
    builder
}

#[test]
fn builder_file_is_valid() {
    let file = parse(valid_file().build()).unwrap();
    assert_eq!(file.get("llama.block_count"), Some(&MetadataValue::U32(2)));
    assert_eq!(file.tensor_data(&file.tensors[0]), &[0xAB; 32]);
}

#[test]
fn header_problems() {
    assert_rejected(vec![], "too short");
    assert_rejected(b"GGUF\x03\x00".to_vec(), "too short");
    let mut bad_magic = valid_file().build();
    bad_magic[0] = b'X';
    assert_rejected(bad_magic, "not a GGUF file");
    assert_rejected(
        Builder::header(1, 0, 0).build(),
        "version 1 is not supported",
    );
    assert_rejected(Builder::header(4, 0, 0).build(), "unknown GGUF version 4");
    assert_rejected(
        Builder::header(3u32.swap_bytes(), 0, 0).build(),
        "big-endian",
    );
    let mut big_endian = Builder::default();
    big_endian
        .raw(b"FUGG")
        .raw(&3u32.to_be_bytes())
        .u64(0)
        .u64(0);
    assert_rejected(big_endian.build(), "big-endian");
}

#[test]
fn absurd_counts_are_rejected_before_allocating() {
    assert_rejected(Builder::header(3, u64::MAX, 0).build(), "tensor count");
    assert_rejected(
        Builder::header(3, 0, 1 << 40).build(),
        "metadata key/value count",
    );
    let mut long_key = Builder::header(3, 0, 1);
    long_key.u64(u64::MAX - 3).raw(b"key").raw(&[0; 16]);
    assert_rejected(long_key.build(), "string length");
    let mut long_array = Builder::header(3, 0, 1);
    long_array
        .string(b"k")
        .u32(9)
        .u32(10)
        .u64(1 << 61)
        .raw(&[0; 64]);
    assert_rejected(long_array.build(), "array length");
    // An array of arrays that each claim many elements: the inner count is checked too.
    let mut nested = Builder::header(3, 0, 1);
    nested.string(b"k").u32(9).u32(9).u64(2).u32(4).u64(1 << 40);
    assert_rejected(nested.build(), "array length");
}

#[test]
fn malformed_metadata_values() {
    let mut unknown_type = Builder::header(3, 0, 1);
    unknown_type.string(b"key").u32(13).u32(0);
    assert_rejected(unknown_type.build(), "unknown metadata value type 13");

    let mut bad_key = Builder::header(3, 0, 1);
    bad_key.string(&[0x66, 0xFF, 0x66]).u32(4).u32(0);
    assert_rejected(bad_key.build(), "not valid UTF-8");

    let mut bad_string = Builder::header(3, 0, 1);
    bad_string.string(b"key").u32(8).string(&[0xC3, 0x28]);
    assert_rejected(bad_string.build(), "not valid UTF-8");

    let mut bad_bool = Builder::header(3, 0, 1);
    bad_bool.string(b"flag").u32(7).raw(&[2]);
    assert_rejected(bad_bool.build(), "must be 0 or 1");

    let mut bad_element_type = Builder::header(3, 0, 1);
    bad_element_type.string(b"list").u32(9).u32(77).u64(1);
    assert_rejected(bad_element_type.build(), "unknown element type 77");

    let mut duplicate_key = Builder::header(3, 0, 2);
    duplicate_key.kv_u32("k", 1).kv_u32("k", 2);
    assert_rejected(duplicate_key.build(), "appears more than once");

    // Arrays nested 9 deep (each level: type 9, length 1), ending in a u8.
    let mut deep = Builder::header(3, 0, 1);
    deep.string(b"deep").u32(9);
    for _ in 0..9 {
        deep.u32(9).u64(1);
    }
    deep.u32(0).u64(1).raw(&[7]);
    assert_rejected(deep.build(), "nests deeper");
}

#[test]
fn empty_arrays_and_tensorless_files_are_fine() {
    let mut builder = Builder::header(2, 0, 1);
    builder.string(b"empty").u32(9).u32(8).u64(0);
    let file = parse(builder.build()).unwrap();
    assert_eq!(file.get("empty"), Some(&MetadataValue::Array(vec![])));
    assert!(file.tensors.is_empty());
}

#[test]
fn bad_alignment() {
    for (alignment, needle) in [(48, "power of two"), (0, "power of two")] {
        let mut builder = Builder::header(3, 0, 1);
        builder.kv_u32("general.alignment", alignment);
        assert_rejected(builder.build(), needle);
    }
    let mut as_string = Builder::header(3, 0, 1);
    as_string.string(b"general.alignment").u32(8).string(b"32");
    assert_rejected(
        as_string.build(),
        "general.alignment must be an unsigned integer",
    );
}

#[test]
fn malformed_tensor_infos() {
    let with_tensor = |dims: &[u64], ty: u32, offset: u64, data_len: usize| {
        let mut builder = Builder::header(3, 1, 0);
        builder
            .tensor_info("t", dims, ty, offset)
            .data(32, data_len);
        builder.build()
    };
    assert_rejected(with_tensor(&[1 << 40, 1 << 40], 0, 0, 32), "overflow");
    assert_rejected(with_tensor(&[u64::MAX], 0, 0, 32), "too large");
    assert_rejected(
        with_tensor(&[1, 1, 1, 1, 1], 0, 0, 32),
        "at most 4 are allowed",
    );
    assert_rejected(
        with_tensor(&[8], 0, 16, 64),
        "not a multiple of the alignment 32",
    );
    assert_rejected(with_tensor(&[8], 0, 32, 32), "data section");
    assert_rejected(with_tensor(&[64], 0, 0, 32), "file truncated");
    assert_rejected(with_tensor(&[33], 8, 0, 64), "block size 32");
    // An offset so large that offset + size overflows.
    assert_rejected(with_tensor(&[8], 0, u64::MAX - 31, 32), "data section");

    let mut duplicate = Builder::header(3, 2, 0);
    duplicate
        .tensor_info("same", &[8], 0, 0)
        .tensor_info("same", &[8], 0, 32)
        .data(32, 64);
    assert_rejected(
        duplicate.build(),
        "tensor name `same` appears more than once",
    );

    // Tensor infos that claim more bytes than the header has.
    let mut truncated = Builder::header(3, 1, 0);
    truncated.string(b"t").u32(2).u64(8);
    assert_rejected(truncated.build(), "unexpected end of file");

    // Data section start is past the end of the file.
    let mut no_data = Builder::header(3, 1, 0);
    no_data.tensor_info("t", &[0], 0, 0);
    no_data.raw(&[0]);
    assert_rejected(no_data.build(), "past the end");
}

#[test]
fn unknown_tensor_type_parses_and_only_decoding_fails() {
    // Huge dims are fine for an unknown type (its size is unknown); decoding must fail
    // before allocating for them (found by fuzzing).
    let mut builder = Builder::header(3, 2, 0);
    builder
        .tensor_info("iq", &[256, 1 << 40], 39, 0)
        .tensor_info("f", &[8], 0, 96)
        .data(32, 128);
    let file = parse(builder.build()).unwrap();
    let unknown = file.tensor("iq").unwrap();
    assert_eq!(unknown.ty, GgmlType::Other(39));
    assert_eq!(
        unknown.n_bytes, 96,
        "upper bound: bytes up to the next tensor"
    );
    let error = file.tensor_to_f32(unknown).unwrap_err().to_string();
    assert!(
        error.contains(LABEL) && error.contains("not supported"),
        "{error}"
    );
    assert_eq!(file.tensor("f").unwrap().n_bytes, 32);
    // Known-but-undecodable types have an exact size and also fail only when decoded.
    // (Q8_1: llama.cpp's activation format, never a weight; 36 bytes per 32 values.)
    let mut q8_1 = Builder::header(3, 1, 0);
    q8_1.tensor_info("q", &[32], 9, 0).data(32, 64);
    let file = parse(q8_1.build()).unwrap();
    assert_eq!(file.tensors[0].n_bytes, 36);
    assert!(file.tensor_to_f32(&file.tensors[0]).is_err());
}

fn fixture_bytes() -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf/all_types_v3.gguf");
    std::fs::read(path).unwrap()
}

/// Cutting the fixture anywhere before the end of its last tensor is an error; cutting in
/// the trailing padding is not.
#[test]
fn truncation_at_every_offset() {
    let bytes = fixture_bytes();
    let file = parse(bytes.clone()).unwrap();
    let needed = file
        .tensors
        .iter()
        .map(|t| file.data_offset + t.offset + t.n_bytes)
        .max()
        .unwrap() as usize;
    for cut in 0..bytes.len() {
        let result = parse(bytes[..cut].to_vec());
        if cut < needed {
            let message = result
                .err()
                .unwrap_or_else(|| panic!("cut at {cut} parsed"));
            assert!(message.starts_with(LABEL), "{message}");
        } else {
            assert!(result.is_ok(), "cut at {cut} (in padding) failed");
        }
    }
}

/// Truncated files on disk: the error names the real path.
#[test]
fn truncated_file_on_disk_names_the_path() {
    let bytes = fixture_bytes();
    let dir = std::env::temp_dir().join(format!("pagoda-gguf-corrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for cut in [0, 3, 9, 24, 100, 700, 1500, 2300] {
        let path = dir.join(format!("cut_{cut}.gguf"));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let error = GgufFile::open(&path).unwrap_err().to_string();
        assert!(error.contains(&format!("cut_{cut}.gguf")), "{error}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every header byte replaced by several patterns: never a panic, and errors name the file.
#[test]
fn byte_flips_never_panic() {
    let bytes = fixture_bytes();
    let header_length = parse(bytes.clone()).unwrap().data_offset as usize;
    for position in 0..header_length {
        for pattern in [0x00, 0xFF, 0x80, 0x01] {
            let mut corrupt = bytes.clone();
            corrupt[position] ^= pattern;
            if let Err(message) = parse(corrupt) {
                assert!(message.starts_with(LABEL), "{message}");
            }
        }
    }
}
