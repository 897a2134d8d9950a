//! Named async locks that do not outlive their use: the per-session locks and the
//! per-(stack, branch) gates. An entry is removed when its last user lets go, so
//! a daemon that served a million sessions holds no million mutexes.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// A map of async mutexes by key, pruned on release.
pub struct LockMap<K: Eq + Hash + Clone> {
    map: Arc<Mutex<HashMap<K, Arc<AsyncMutex<()>>>>>,
}

/// A held lock of a [`LockMap`]; releases (and prunes) on drop.
pub struct LockGuard<K: Eq + Hash + Clone> {
    guard: Option<OwnedMutexGuard<()>>,
    entry: Arc<AsyncMutex<()>>,
    map: Arc<Mutex<HashMap<K, Arc<AsyncMutex<()>>>>>,
    key: K,
}

impl<K: Eq + Hash + Clone> Default for LockMap<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Eq + Hash + Clone> LockMap<K> {
    pub fn new() -> Self {
        Self {
            map: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn entry(&self, key: &K) -> Arc<AsyncMutex<()>> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_insert_with(|| Arc::new(AsyncMutex::new(())))
            .clone()
    }

    fn guard(&self, key: K, entry: Arc<AsyncMutex<()>>, g: OwnedMutexGuard<()>) -> LockGuard<K> {
        LockGuard {
            guard: Some(g),
            entry,
            map: self.map.clone(),
            key,
        }
    }

    /// Waits for the lock of `key`.
    pub async fn lock(&self, key: K) -> LockGuard<K> {
        let entry = self.entry(&key);
        let g = entry.clone().lock_owned().await;
        self.guard(key, entry, g)
    }

    /// Whether `key` is held now.
    pub(crate) fn is_locked(&self, key: &K) -> bool {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(key).is_some_and(|m| m.try_lock().is_err())
    }

    /// Number of live entries (held or waited for).
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

fn prune<K: Eq + Hash>(
    map: &Mutex<HashMap<K, Arc<AsyncMutex<()>>>>,
    key: &K,
    entry: &Arc<AsyncMutex<()>>,
) {
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    // The map's reference and the caller's: nobody else holds or waits.
    if Arc::strong_count(entry) == 2 && map.get(key).is_some_and(|e| Arc::ptr_eq(e, entry)) {
        map.remove(key);
    }
}

impl<K: Eq + Hash + Clone> Drop for LockGuard<K> {
    fn drop(&mut self) {
        self.guard.take();
        prune(&self.map, &self.key, &self.entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn entries_are_pruned_when_the_last_user_lets_go() {
        let m: LockMap<i64> = LockMap::new();
        let a = m.lock(1).await;
        assert!(m.is_locked(&1), "held");
        let waiter = {
            let map = LockMap { map: m.map.clone() };
            tokio::spawn(async move {
                let _g = map.lock(1).await;
            })
        };
        tokio::task::yield_now().await;
        drop(a);
        waiter.await.ok();
        assert_eq!(m.len(), 0, "pruned after the waiter released");
        let b = m.lock(2).await;
        assert_eq!(m.len(), 1);
        drop(b);
        assert_eq!(m.len(), 0);
    }
}
