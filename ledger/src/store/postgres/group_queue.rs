//! Jobs waiting for a group worker (decisions, outcome reports): the first job to arrive
//! when no worker runs starts one; the worker takes groups until it finds the queue empty
//! and then ends, under the same lock as the joins, so no job is ever left without a worker.

use std::sync::Mutex;

/// Most jobs one group transaction takes.
pub(super) const MAX_GROUP: usize = 256;

/// `None` inside: no worker runs.
pub(super) struct GroupQueue<T>(Mutex<Option<Vec<T>>>);

impl<T> Default for GroupQueue<T> {
    fn default() -> Self {
        GroupQueue(Mutex::new(None))
    }
}

impl<T> GroupQueue<T> {
    /// Adds the jobs, in order, to the next group. True when no worker runs: the caller must
    /// start one.
    pub(super) fn join(&self, jobs: impl IntoIterator<Item = T>) -> bool {
        let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match q.as_mut() {
            Some(waiting) => {
                waiting.extend(jobs);
                false
            }
            None => {
                *q = Some(jobs.into_iter().collect());
                true
            }
        }
    }

    /// The next group, oldest first, at most [`MAX_GROUP`] jobs. `None` when nothing waits:
    /// the worker must end (the next job to join starts a new one).
    pub(super) fn next_group(&self) -> Option<Vec<T>> {
        let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = q.as_mut()?;
        if waiting.is_empty() {
            *q = None;
            return None;
        }
        let n = waiting.len().min(MAX_GROUP);
        Some(waiting.drain(..n).collect())
    }

    /// Jobs waiting (`None`: no worker runs).
    #[cfg(test)]
    pub(super) fn waiting(&self) -> Option<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_join_starts_a_worker_and_an_empty_queue_ends_it() {
        let q = GroupQueue::default();
        assert!(q.join([1, 2]));
        assert!(!q.join([3]), "a worker runs already");
        assert_eq!(q.waiting(), Some(3));
        assert_eq!(q.next_group(), Some(vec![1, 2, 3]));
        assert_eq!(q.next_group(), None, "empty: the worker ends");
        assert_eq!(q.waiting(), None);
        assert!(q.join([4]), "the next job starts a new worker");
    }

    #[test]
    fn a_group_takes_at_most_max_group_jobs_oldest_first() {
        let q = GroupQueue::default();
        q.join(0..MAX_GROUP + 5);
        let first = q.next_group().unwrap_or_default();
        assert_eq!(first.len(), MAX_GROUP);
        assert_eq!(first.first(), Some(&0));
        assert_eq!(q.next_group(), Some((MAX_GROUP..MAX_GROUP + 5).collect()));
    }
}
