//! Fuzzes the GGUF parser on in-memory bytes: parsing must never panic, and whatever parses
//! must hand out in-bounds tensor slices that decode (or report an unsupported type).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagoda_models::formats::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz-input.gguf", data.to_vec()) else {
        return;
    };
    assert!(file.version == 2 || file.version == 3);
    assert!(file.alignment.is_power_of_two());
    for info in &file.tensors {
        let bytes = file.tensor_data(info);
        assert_eq!(bytes.len() as u64, info.n_bytes);
        // Bounded by the input size: a tensor's values never outnumber twice its bytes.
        let _ = file.tensor_to_f32(info);
    }
    for key in file.metadata.keys() {
        let _ = file.get_str(key);
        let _ = file.get_u32(key);
        let _ = file.get_f32(key);
        let _ = file.get_string_array(key);
        let _ = file.get_i32_array(key);
    }
    let _ = format!("{file:?}");
});
