//! The decoder's tests, one binary: captured bytes of a real server
//! ([`fixtures`], from `tests/fixtures/`) and arbitrary bytes ([`arbitrary_bytes`]).

mod arbitrary_bytes;
mod fixtures;
