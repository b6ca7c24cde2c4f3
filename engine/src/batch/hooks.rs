//! Completion hooks: run once when a batch has no unfinished task left.

use super::lifecycle::BatchInner;
use super::sync::Ordering;

/// Called once when a batch has no unfinished task left; see
/// [`Batch::on_complete`](super::Batch::on_complete).
pub(super) type CompletionHook = Box<dyn FnOnce() + Send>;

/// The hooks a batch holds, shown by count.
#[derive(Default)]
pub(super) struct Hooks(Vec<CompletionHook>);

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} completion hook(s)", self.0.len())
    }
}

impl BatchInner {
    /// Runs `hook` once no task is unfinished: now, if none is, else from the thread that
    /// finishes the last one.
    pub(crate) fn on_complete(&self, hook: CompletionHook) {
        let mut hooks = self.hooks.lock();
        // The flag goes up before the count is read, and a finisher reads the flag after its
        // decrement (all SeqCst): either this read sees the last decrement, or that finisher
        // sees the flag and takes the hooks lock, after this hook is in the list.
        self.has_hooks.store(true, Ordering::SeqCst);
        if self.counts.unfinished() == 0 {
            if hooks.0.is_empty() {
                self.has_hooks.store(false, Ordering::SeqCst);
            }
            drop(hooks);
            hook();
            return;
        }
        hooks.0.push(hook);
    }

    pub(super) fn run_hooks(&self) {
        let ready = {
            let mut hooks = self.hooks.lock();
            if self.counts.unfinished() != 0 {
                // A submit reserved more tasks since: the hooks wait for those too.
                return;
            }
            self.has_hooks.store(false, Ordering::SeqCst);
            std::mem::take(&mut hooks.0)
        };
        for hook in ready {
            hook();
        }
    }
}
