//! Protection domains.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use crate::device::Context;
use crate::error::{VerbsError, errno};

/// A protection domain.
#[derive(Debug)]
pub struct ProtectionDomain {
    pub(crate) pd: NonNull<sys::ibv_pd>,
    context: Arc<Context>,
}

// SAFETY: verbs objects are thread-safe; the pointer is released only in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see Send.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a protection domain on `context`.
    pub fn new(context: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open for as long as the Arc lives.
        let pd = unsafe { sys::ibv_alloc_pd(context.ctx.as_ptr()) };
        NonNull::new(pd)
            .map(|pd| {
                Arc::new(Self {
                    pd,
                    context: context.clone(),
                })
            })
            .ok_or_else(|| VerbsError::AllocPd(errno()))
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc of the PD, so none is alive; freed once.
        unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}
