//! [`Routes`]: the transports that reach one peer, best first.

/// The transports that reach one peer, best first.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Routes {
    order: [u8; Routes::MAX],
    len: u8,
}

impl Routes {
    /// Transports an engine may have.
    pub(crate) const MAX: usize = 8;

    pub(crate) fn push(&mut self, transport: usize) {
        if (self.len as usize) < Self::MAX {
            self.order[self.len as usize] = transport as u8;
            self.len += 1;
        }
    }

    pub(crate) fn first(&self) -> Option<usize> {
        self.get(0)
    }

    pub(crate) fn get(&self, rank: usize) -> Option<usize> {
        (rank < self.len as usize).then(|| self.order[rank] as usize)
    }
}
