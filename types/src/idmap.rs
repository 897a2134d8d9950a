//! A session's uid/gid mapping: its processes run in a user namespace whose
//! ids `0..size` are the host's `host_uid..host_uid+size` (and the same for
//! gids), user_namespaces(7). Layers keep the session's ids (what a
//! container's tar would carry); only the session's processes run as the
//! host's shifted ids, so the session's root is no root of the host.

use std::fmt;
use std::str::FromStr;

/// One contiguous uid range and one gid range of the same size, as
/// `/proc/PID/uid_map` takes them (`0 host_uid size`, `0 host_gid size`).
///
/// ```
/// use layerstack_types::IdMap;
/// let m: IdMap = "100000:100000:65536".parse()?;
/// assert_eq!(m.uid_to_host(1000), Some(101000));
/// assert_eq!(m.uid_from_host(101000), Some(1000));
/// assert_eq!(m.uid_from_host(0), None);
/// assert_eq!(m.to_string(), "100000:100000:65536");
/// # Ok::<(), layerstack_types::BadIdMap>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct IdMap {
    /// The host uid the session's uid 0 is.
    pub host_uid: u32,
    /// The host gid the session's gid 0 is.
    pub host_gid: u32,
    /// How many ids are mapped (the session's ids `0..size`).
    pub size: u32,
}

/// Why an [`IdMap`] is refused: the field and the rule, as a sentence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadIdMap(pub String);

impl IdMap {
    /// Checks the mapping: `size` ≥ 1; `host_uid` and `host_gid` ≥ `size`
    /// (so no host id of the range is also a session id: the shift of a
    /// session's upper back to the session's ids can be repeated after a
    /// crash without shifting an id twice, and host root is never mapped);
    /// the ranges end below 2³² − 1 (the kernel's invalid id).
    pub fn validate(&self) -> Result<(), BadIdMap> {
        if self.size == 0 {
            return Err(BadIdMap(
                "id_map.size is 0: map at least one id (65536 is usual)".into(),
            ));
        }
        for (field, host) in [("host_uid", self.host_uid), ("host_gid", self.host_gid)] {
            if host < self.size {
                return Err(BadIdMap(format!(
                    "id_map.{field} {host} is below id_map.size {}: the host range must lie above the session's ids 0..{} (e.g. {field} = 100000 with size = 65536)",
                    self.size, self.size
                )));
            }
            if u64::from(host) + u64::from(self.size) > u64::from(u32::MAX) {
                return Err(BadIdMap(format!(
                    "id_map.{field} {host} + size {} passes the largest id 4294967294",
                    self.size
                )));
            }
        }
        Ok(())
    }

    /// The host uid of the session's `uid`; `None` outside the mapping.
    pub fn uid_to_host(&self, uid: u32) -> Option<u32> {
        (uid < self.size).then(|| self.host_uid + uid)
    }

    /// The host gid of the session's `gid`; `None` outside the mapping.
    pub fn gid_to_host(&self, gid: u32) -> Option<u32> {
        (gid < self.size).then(|| self.host_gid + gid)
    }

    /// The session's uid of host uid `uid`; `None` outside the mapping.
    pub fn uid_from_host(&self, uid: u32) -> Option<u32> {
        uid.checked_sub(self.host_uid).filter(|u| *u < self.size)
    }

    /// The session's gid of host gid `gid`; `None` outside the mapping.
    pub fn gid_from_host(&self, gid: u32) -> Option<u32> {
        gid.checked_sub(self.host_gid).filter(|g| *g < self.size)
    }
}

impl fmt::Display for IdMap {
    /// `HOST_UID:HOST_GID:SIZE`, what [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.host_uid, self.host_gid, self.size)
    }
}

impl FromStr for IdMap {
    type Err = BadIdMap;

    /// `HOST_UID:HOST_GID:SIZE` (decimal), checked by [`IdMap::validate`].
    fn from_str(s: &str) -> Result<Self, BadIdMap> {
        let bad = || {
            BadIdMap(format!(
                "id map {s:?} is not HOST_UID:HOST_GID:SIZE (decimal, e.g. 100000:100000:65536)"
            ))
        };
        let mut it = s.split(':').map(|p| p.parse::<u32>().map_err(|_| bad()));
        let m = IdMap {
            host_uid: it.next().ok_or_else(bad)??,
            host_gid: it.next().ok_or_else(bad)??,
            size: it.next().ok_or_else(bad)??,
        };
        if it.next().is_some() {
            return Err(bad());
        }
        m.validate()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn refuses_what_would_shift_twice_or_overflow() {
        assert!("0:0:65536".parse::<IdMap>().is_err());
        assert!("1000:100000:65536".parse::<IdMap>().is_err());
        assert!("100000:100000:0".parse::<IdMap>().is_err());
        assert!("4294950000:100000:65536".parse::<IdMap>().is_err());
        assert!("100000:100000".parse::<IdMap>().is_err());
        assert!("100000:100000:65536:1".parse::<IdMap>().is_err());
        let m: IdMap = "200000:300000:1000".parse().unwrap();
        assert_eq!(m.gid_to_host(999), Some(300999));
        assert_eq!(m.gid_to_host(1000), None);
        assert_eq!(m.gid_from_host(299999), None);
        assert_eq!(m.uid_from_host(200999), Some(999));
        assert_eq!(m.uid_from_host(201000), None);
    }
}
