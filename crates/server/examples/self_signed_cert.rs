//! Writes a self-signed certificate for `localhost` and `127.0.0.1` (`cert.pem`, `key.pem`) into
//! the folder given, for the live-server suite's HTTPS tests (`scripts/test-server.sh`).
//!
//! `cargo run -p pagoda-server --example self_signed_cert -- DIR`

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: self_signed_cert DIR");
        std::process::exit(2);
    };
    let dir = std::path::PathBuf::from(dir);
    let made = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
        .expect("rcgen makes a self-signed certificate");
    std::fs::create_dir_all(&dir).expect("creating the certificate folder");
    std::fs::write(dir.join("cert.pem"), made.cert.pem()).expect("writing cert.pem");
    std::fs::write(dir.join("key.pem"), made.signing_key.serialize_pem()).expect("writing key.pem");
}
