//! Nanoseconds to seal one datagram (1,400 and 1,500 bytes, a 9-byte header authenticated, as the udp carriers'
//! `Sealed` packets) with ChaCha20-Poly1305, AES-256-GCM and AES-128-GCM of `ring`: the best of 3 runs of 200,000.
//! `cargo bench --profile ci -p flexstack-faces --bench aead`
use ring::aead::{Aad, Algorithm, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM, CHACHA20_POLY1305};
use std::time::Instant;

fn bench(alg: &'static Algorithm, name: &str, len: usize) {
    let key = LessSafeKey::new(UnboundKey::new(alg, &vec![7u8; alg.key_len()]).expect("a key"));
    let mut buf = vec![1u8; len];
    let n = 200_000u64;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for i in 0..n {
            let mut nonce = [0u8; 12];
            nonce[4..].copy_from_slice(&i.to_be_bytes());
            let tag = key
                .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from([3u8; 9]), &mut buf)
                .expect("sealed");
            let _ = std::hint::black_box(tag);
        }
        best = best.min(t.elapsed().as_secs_f64() / n as f64 * 1e9);
    }
    println!("{name:<18} {len} bytes: {best:5.0} ns per datagram ({:.2} GB/s)", len as f64 / best);
}

fn main() {
    for len in [1400, 1500] {
        bench(&CHACHA20_POLY1305, "chacha20-poly1305", len);
        bench(&AES_256_GCM, "aes-256-gcm", len);
        bench(&AES_128_GCM, "aes-128-gcm", len);
    }
}
