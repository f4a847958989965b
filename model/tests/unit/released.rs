//! The released tensor list (`src/released.rs`): its shard size table.

use k3_model::released::*;

#[test]
fn size_table_is_the_tensor_list() {
    let mut payload = 0u64;
    for (k, &want) in SHARD_SIZES.iter().enumerate() {
        let (json, data) = header_json(&shard_tensors(k + 1));
        assert_eq!(8 + json.len() as u64 + data, want, "shard {}", k + 1);
        payload += data;
    }
    assert_eq!(SHARD_SIZES.iter().sum::<u64>(), RELEASED_BYTES);
    assert_eq!(payload, RELEASED_PAYLOAD);
}
