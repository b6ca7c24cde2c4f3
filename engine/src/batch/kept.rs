//! Task tables and merged runs' parts kept from batches gone for the batches to come. A
//! batch of many thousand tasks has a table of several megabytes; given back to the
//! allocator as it goes, the next such batch gets memory the kernel hands out afresh, a page
//! fault per 4 KiB (the main thread's heap of a Python process gives it back at once, and
//! faulting it in again cost a 100 000-descriptor call more than the binding's own work).
//! Kept, the next table only has its tasks written as new.

use parking_lot::Mutex;

use super::task::TaskState;
use crate::transport::TaskPart;

/// Lists of fewer entries are not kept: the allocator reuses room this small without the
/// kernel.
pub(crate) const KEEP_FROM: usize = 4096;

/// The most lists of one kind kept, and the most entries' room they hold together (32 MiB
/// of tasks, 16 MiB of parts).
const KEEP_LISTS: usize = 4;
const KEEP_AT_MOST: usize = 1 << 20;

/// What an engine keeps for its batches to come, shared by its large batches (of
/// [`KEEP_FROM`] tasks or more), which give their lists back as they go.
#[derive(Debug, Default)]
pub(crate) struct KeptRoom {
    /// Task tables.
    pub(crate) tasks: Kept<TaskState>,
    /// The parts of merged runs.
    pub(crate) parts: Kept<TaskPart>,
}

/// Lists of one kind, kept.
#[derive(Debug)]
pub(crate) struct Kept<T> {
    lists: Mutex<Vec<Vec<T>>>,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Self {
            lists: Mutex::default(),
        }
    }
}

impl<T> Kept<T> {
    /// An empty list with room for `len` entries: the smallest kept list that has it, else
    /// a new one (whose room is then what is kept if it comes back).
    pub(crate) fn room(&self, len: usize) -> Vec<T> {
        let kept = if len >= KEEP_FROM {
            let mut lists = self.lists.lock();
            lists
                .iter()
                .enumerate()
                .filter(|(_, list)| list.capacity() >= len)
                .min_by_key(|(_, list)| list.capacity())
                .map(|(at, _)| at)
                .map(|at| lists.swap_remove(at))
        } else {
            None
        };
        let mut list = kept.unwrap_or_else(|| Vec::with_capacity(len));
        list.clear();
        list
    }

    /// Keeps the list of a batch or run gone, if it is large and there is room for it.
    #[cold]
    #[inline(never)]
    pub(crate) fn keep(&self, list: Vec<T>) {
        if list.len() < KEEP_FROM {
            return;
        }
        let mut lists = self.lists.lock();
        let held: usize = lists.iter().map(Vec::capacity).sum();
        if lists.len() < KEEP_LISTS && held + list.capacity() <= KEEP_AT_MOST {
            lists.push(list);
        }
    }

    /// How many lists are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lists.lock().len()
    }
}

/// A task table of `capacity` tasks, each as new. Apart from the path of small batches,
/// which it would only lengthen.
#[cold]
#[inline(never)]
pub(crate) fn new_tasks(kept: &Kept<TaskState>, capacity: usize) -> Vec<TaskState> {
    let mut tasks = kept.room(capacity);
    tasks.resize_with(capacity, TaskState::default);
    tasks
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn a_kept_table_comes_back_with_every_task_as_new() {
        let kept = Kept::default();
        let table = new_tasks(&kept, KEEP_FROM * 2);
        for task in table.iter() {
            task.state.store(u64::MAX, Ordering::Relaxed);
            task.slices_total.store(7, Ordering::Relaxed);
            task.progress.store(9, Ordering::Relaxed);
            task.uncredited.store(3, Ordering::Relaxed);
            task.remote_may_change.store(true, Ordering::Relaxed);
        }
        let at = table.as_ptr();
        kept.keep(table);
        assert_eq!(kept.len(), 1);
        let again = new_tasks(&kept, KEEP_FROM + 1);
        assert_eq!(again.as_ptr(), at, "the kept room is reused");
        assert_eq!(again.len(), KEEP_FROM + 1);
        assert_eq!(kept.len(), 0);
        for task in again.iter() {
            assert_eq!(task.state.load(Ordering::Relaxed), 0);
            assert_eq!(task.slices_total.load(Ordering::Relaxed), 0);
            assert_eq!(task.progress.load(Ordering::Relaxed), 0);
            assert_eq!(task.uncredited.load(Ordering::Relaxed), 0);
            assert!(!task.remote_may_change.load(Ordering::Relaxed));
        }
    }

    #[test]
    fn small_lists_are_not_kept_and_the_room_kept_is_bounded() {
        let kept = Kept::default();
        kept.keep(new_tasks(&kept, KEEP_FROM - 1));
        assert_eq!(kept.len(), 0, "a small table goes back to the allocator");
        kept.keep(new_tasks(&kept, KEEP_FROM));
        let larger = new_tasks(&kept, KEEP_FROM + 1);
        assert_eq!(larger.len(), KEEP_FROM + 1);
        assert_eq!(kept.len(), 1, "a table too small for the batch stays kept");
        kept.keep(larger);
        // Lists past the count, or past the entries' room, go.
        for _ in 0..KEEP_LISTS {
            kept.keep(made_new(KEEP_FROM));
        }
        assert_eq!(kept.len(), KEEP_LISTS);
        let kept: Kept<TaskState> = Kept::default();
        kept.keep(made_new(KEEP_AT_MOST));
        kept.keep(made_new(KEEP_FROM));
        assert_eq!(kept.len(), 1);
    }

    #[test]
    fn a_list_of_another_length_is_filled_in_the_smallest_kept_room_that_fits() {
        let kept: Kept<u64> = Kept::default();
        let (small, large) = (made_new(KEEP_FROM), made_new(KEEP_FROM * 3));
        let large_at = large.as_ptr() as usize;
        kept.keep(large);
        kept.keep(small);
        let mut list = kept.room(KEEP_FROM * 2);
        list.extend(0..KEEP_FROM as u64 * 2);
        assert_eq!(list.len(), KEEP_FROM * 2);
        assert_eq!(list[KEEP_FROM * 2 - 1], KEEP_FROM as u64 * 2 - 1);
        assert_eq!(
            list.as_ptr() as usize,
            large_at,
            "only the larger room fits"
        );
        assert_eq!(kept.len(), 1);
    }

    /// A list made new, whatever is kept.
    fn made_new<T: Default>(len: usize) -> Vec<T> {
        (0..len).map(|_| T::default()).collect()
    }
}
