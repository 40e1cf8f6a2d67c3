//! The decoder never panics, whatever bytes it is fed.

use bytes::Bytes;
use proptest::prelude::*;
use replication::decode;

const TAGS: &[u8] = b"BCORYIUDTM";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&Bytes::from(data));
    }

    /// A valid tag in front makes the fuzzer reach past the first byte.
    #[test]
    fn arbitrary_bodies_behind_a_valid_tag_never_panic(
        tag in proptest::sample::select(TAGS),
        body in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut data = vec![tag];
        data.extend(body);
        let _ = decode(&Bytes::from(data));
    }
}
