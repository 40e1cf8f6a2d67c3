//! The decoder against pgoutput bytes captured from a real PostgreSQL 15
//! server by `scripts/capture-pgoutput-fixtures`.

use bytes::Bytes;
use replication::{decode, DecodeError, LogicalMessage, RelationCache, TupleValue};

fn load(name: &str) -> Vec<Bytes> {
    let path = format!("{}/tests/fixtures/{name}.hex", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| Bytes::from(hex_decode(l.trim()))).collect()
}

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn decode_all(name: &str) -> Vec<LogicalMessage> {
    load(name).iter().map(|b| decode(b).unwrap_or_else(|e| panic!("{name}: {e}"))).collect()
}

fn text(v: &TupleValue) -> &str {
    v.as_str().expect("a text value").expect("utf-8")
}

#[test]
fn outbox_inserts_and_messages() {
    let msgs = decode_all("outbox_inserts");
    let mut cache = RelationCache::new();
    let LogicalMessage::Begin { final_lsn, xid, .. } = &msgs[0] else { panic!("{:?}", msgs[0]) };
    assert!(final_lsn.0 > 0 && *xid > 0);

    assert!(cache.observe(&msgs[1]));
    let LogicalMessage::Relation(rel) = &msgs[1] else { panic!() };
    assert_eq!((rel.namespace.as_str(), rel.name.as_str()), ("public", "outbox"));
    let names: Vec<_> = rel.columns.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "id",
            "event_id",
            "destination",
            "body",
            "group_key",
            "attributes",
            "created_at",
            "status",
            "attempts",
            "next_attempt_at",
            "last_error",
            "published_at"
        ]
    );
    assert!(rel.columns[0].key && !rel.columns[1].key);
    assert_eq!(rel.columns[0].type_oid, 20); // int8
    assert_eq!(rel.columns[5].type_oid, 3802); // jsonb

    let LogicalMessage::Insert { relation, new } = &msgs[2] else { panic!() };
    let rel = cache.get(*relation).expect("relation cached");
    let col = |n: &str| rel.column_index(n).unwrap();
    assert_eq!(text(&new.0[col("event_id")]), "order.created:abc:0");
    assert_eq!(text(&new.0[col("body")]), "{\"order\":1}");
    assert_eq!(new.0[col("group_key")], TupleValue::Null);
    assert_eq!(new.0[col("attributes")], TupleValue::Null);

    let LogicalMessage::Insert { new, .. } = &msgs[3] else { panic!() };
    assert_eq!(text(&new.0[col("body")]), "héllo wörld ✓");
    assert_eq!(text(&new.0[col("group_key")]), "customer-7");
    assert_eq!(text(&new.0[col("attributes")]), "{\"n\": 3, \"kind\": \"paid\"}");

    let LogicalMessage::Commit { commit_lsn, end_lsn, .. } = &msgs[4] else { panic!() };
    assert_eq!(commit_lsn, final_lsn);
    assert!(end_lsn > commit_lsn);

    // The transactional heartbeat: Begin, Message, Commit.
    let LogicalMessage::Message { transactional, prefix, content, .. } = &msgs[6] else { panic!() };
    assert!(*transactional);
    assert_eq!(prefix, "outbox_relay_heartbeat");
    assert_eq!(&content[..], b"2026-12-01 00:00:00+00");
    // A non-transactional message stands alone.
    let LogicalMessage::Message { transactional, prefix, .. } = &msgs[8] else { panic!() };
    assert!(!*transactional);
    assert_eq!(prefix, "nontx");
}

#[test]
fn every_other_message_type() {
    let msgs = decode_all("all_ops");
    let tags: String = load("all_ops").iter().map(|b| b[0] as char).collect();
    assert_eq!(tags, "BYRICBUCBUCBDCBRICBUCBDCBYRRTC");

    let LogicalMessage::Type { namespace, name, oid } = &msgs[1] else { panic!() };
    assert_eq!((namespace.as_str(), name.as_str()), ("public", "mood"));
    assert!(*oid > 16384);

    // Insert of a row with a 128 kB text column: compressed in the table, sent in full.
    let LogicalMessage::Insert { new, .. } = &msgs[3] else { panic!() };
    assert_eq!(new.0.len(), 6);
    assert_eq!(text(&new.0[2]).len(), 32 * 4000);
    assert_eq!(text(&new.0[3]), "happy");
    assert_eq!(text(&new.0[5]), "\\x00ff");

    // Update leaving the big column alone: unchanged TOAST, no old tuple.
    let LogicalMessage::Update { key, old, new, .. } = &msgs[6] else { panic!() };
    assert!(key.is_none() && old.is_none());
    assert_eq!(text(&new.0[1]), "uno");
    assert_eq!(new.0[2], TupleValue::UnchangedToast);

    // Update changing the key: the old key tuple comes along.
    let LogicalMessage::Update { key, new, .. } = &msgs[9] else { panic!() };
    let key = key.as_ref().expect("old key");
    assert_eq!(text(&key.0[0]), "1");
    assert_eq!(key.0[1], TupleValue::Null);
    assert_eq!(text(&new.0[0]), "2");

    let LogicalMessage::Delete { key: Some(key), old: None, .. } = &msgs[12] else { panic!() };
    assert_eq!(text(&key.0[0]), "2");

    // REPLICA IDENTITY FULL: whole old rows.
    let LogicalMessage::Relation(rel) = &msgs[15] else { panic!() };
    assert_eq!(rel.replica_identity, b'f');
    let LogicalMessage::Update { old: Some(old), new, .. } = &msgs[19] else { panic!() };
    assert_eq!((text(&old.0[1]), text(&new.0[1])), ("a", "b"));
    let LogicalMessage::Delete { old: Some(old), key: None, .. } = &msgs[22] else { panic!() };
    assert_eq!(text(&old.0[1]), "b");

    let LogicalMessage::Truncate { options, relations } = &msgs[28] else { panic!() };
    assert_eq!(relations.len(), 2);
    assert_eq!(*options, 1 | 2); // CASCADE | RESTART IDENTITY
}

#[test]
fn binary_tuples_and_origin() {
    let msgs = decode_all("binary_origin");
    let LogicalMessage::Origin { name, commit_lsn } = &msgs[1] else { panic!("{:?}", msgs[1]) };
    assert_eq!(name, "fixture_origin");
    assert_eq!(commit_lsn.0, 0x1234);
    let LogicalMessage::Insert { new, .. } = &msgs[4] else { panic!() };
    assert_eq!(new.0[0], TupleValue::Binary(Bytes::copy_from_slice(&7i32.to_be_bytes())));
    assert_eq!(new.0[5], TupleValue::Binary(Bytes::from_static(&[0xde, 0xad, 0xbe, 0xef])));
}

#[test]
fn every_truncation_of_every_fixture_is_an_error_not_a_panic() {
    for name in ["outbox_inserts", "all_ops", "binary_origin"] {
        for msg in load(name) {
            for cut in 0..msg.len() {
                let short = msg.slice(..cut);
                assert!(decode(&short).is_err(), "{name}: prefix of {cut} bytes decoded");
            }
            let mut long = msg.to_vec();
            long.push(0);
            assert_eq!(decode(&Bytes::from(long)), Err(DecodeError::Trailing(1)));
        }
    }
}

#[test]
fn hostile_lengths_are_rejected_before_allocating() {
    // Insert claiming 32767 columns with 3 bytes behind it.
    let b = Bytes::from_static(&[b'I', 0, 0, 0, 1, b'N', 0x7f, 0xff, b'n', b'n', b'n']);
    assert!(matches!(decode(&b), Err(DecodeError::Truncated { .. })));
    // A negative column count.
    let b = Bytes::from_static(&[b'I', 0, 0, 0, 1, b'N', 0xff, 0xff]);
    assert!(matches!(decode(&b), Err(DecodeError::Invalid { .. })));
    // A text value claiming 2 GiB.
    let b = Bytes::from_static(&[b'I', 0, 0, 0, 1, b'N', 0, 1, b't', 0x7f, 0xff, 0xff, 0xff]);
    assert!(matches!(decode(&b), Err(DecodeError::Truncated { .. })));
    // A negative text length.
    let b = Bytes::from_static(&[b'I', 0, 0, 0, 1, b'N', 0, 1, b't', 0xff, 0xff, 0xff, 0xfe]);
    assert!(matches!(decode(&b), Err(DecodeError::Invalid { .. })));
    // Truncate claiming a billion relations.
    let b = Bytes::from_static(&[b'T', 0x3b, 0x9a, 0xca, 0x00, 0]);
    assert!(matches!(decode(&b), Err(DecodeError::Truncated { .. })));
    assert_eq!(decode(&Bytes::new()), Err(DecodeError::Empty));
    assert_eq!(decode(&Bytes::from_static(b"Z")), Err(DecodeError::UnknownTag(b'Z')));
}
