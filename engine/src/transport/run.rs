//! A slice of a merged run and the tasks it carries bytes of: the run's parts, which task
//! holds an address, and how many bytes of each task a slice holds.

use super::slice::Slice;

/// One request's part of a merged run: its task, from its local start address up to the
/// next part's (or the run's end).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskPart {
    pub(crate) start: usize,
    pub(crate) task: u32,
}

/// The index of the part of `parts` holding `addr`, searching from `parts[from]` on (a part
/// at or before it).
pub(super) fn part_holding(parts: &[TaskPart], from: usize, addr: usize) -> usize {
    let rest = parts.get(from..).unwrap_or_default();
    from + rest
        .partition_point(|part| part.start <= addr)
        .saturating_sub(1)
}

/// The tasks a slice carries bytes of, with how many bytes of each.
pub(super) struct SliceTasks<'a> {
    /// The merged run's parts, from the first the slice touches; empty for a slice of one
    /// task.
    parts: &'a [TaskPart],
    /// The slice's unvisited range.
    at: usize,
    end: usize,
    only: Option<(usize, u64)>,
}

impl Iterator for SliceTasks<'_> {
    type Item = (usize, u64);

    fn next(&mut self) -> Option<(usize, u64)> {
        if let Some(only) = self.only.take() {
            return Some(only);
        }
        let (part, rest) = self.parts.split_first()?;
        if self.at >= self.end {
            return None;
        }
        let part_end = rest
            .first()
            .map_or(self.end, |next| next.start.min(self.end));
        let bytes = part_end.saturating_sub(self.at) as u64;
        (self.parts, self.at) = (rest, part_end);
        Some((part.task as usize, bytes))
    }
}

impl Slice {
    /// The one task this slice carries bytes of, if it carries bytes of one only: a slice of
    /// one request, or a slice of a merged run that lies inside one request's part.
    pub(super) fn only_task(&self) -> Option<usize> {
        let Some(parts) = self.run.as_deref() else {
            return Some(self.task as usize);
        };
        let first = self.task as usize;
        let end = self.local_addr.saturating_add(self.len);
        match parts.get(first..)? {
            [part] => Some(part.task as usize),
            [part, next, ..] if next.start >= end => Some(part.task as usize),
            _ => None,
        }
    }

    /// The tasks this slice carries bytes of, each with how many.
    pub(super) fn tasks(&self) -> SliceTasks<'_> {
        let Some(parts) = self.run.as_deref() else {
            return SliceTasks {
                parts: &[],
                at: 0,
                end: 0,
                only: Some((self.task as usize, self.len as u64)),
            };
        };
        let first = self.task as usize;
        SliceTasks {
            parts: parts.get(first..).unwrap_or_default(),
            at: self.local_addr,
            end: self.local_addr.saturating_add(self.len),
            only: None,
        }
    }
}
