//! Log sequence numbers: a 64-bit WAL position written `X/Y` (two hex halves).

use std::fmt;
use std::str::FromStr;

/// A WAL position. Ordered; `Lsn(0)` is "invalid / none".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// Why a string is not an LSN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {0:?}: expected two hexadecimal halves such as 16/B374D848")]
pub struct ParseLsnError(pub String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.to_string());
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let valid = |h: &str| !h.is_empty() && h.len() <= 8 && h.bytes().all(|b| b.is_ascii_hexdigit());
        if !valid(hi) || !valid(lo) {
            return Err(err());
        }
        let hi = u64::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u64::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((hi << 32) | lo))
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

impl From<Lsn> for u64 {
    fn from(l: Lsn) -> Self {
        l.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn display_and_parse() {
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!("16/B374D848".parse::<Lsn>().unwrap(), Lsn(0x16_B374_D848));
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        for bad in ["", "16", "/1", "1/", "x/1", "1/2/3", "123456789/0", "+1/2"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} parsed");
        }
    }

    proptest! {
        #[test]
        fn round_trips(v: u64) {
            prop_assert_eq!(Lsn(v).to_string().parse::<Lsn>().unwrap(), Lsn(v));
        }
    }
}
