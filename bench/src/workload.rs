//! What the initiator moves: `--block_size` blocks over the buffer, or the pages workload (the
//! shape of a KV cache as serving stacks move it: layers of pages, in an order the flags
//! choose); and the pattern every buffer holds, which `--verify` checks.

use tern_engine::OwnedBuffer;

use crate::flags::Args;

/// The order a pages workload submits its pages in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PageOrder {
    Contiguous,
    /// Runs of this many consecutive pages, the runs shuffled.
    Runs(usize),
    Shuffled,
}

impl PageOrder {
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        match text {
            "contiguous" => Ok(Self::Contiguous),
            "shuffled" => Ok(Self::Shuffled),
            _ => text
                .strip_prefix("runs:")
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .map(Self::Runs)
                .ok_or_else(|| format!("{text:?} is not contiguous, runs:N (N > 0) or shuffled")),
        }
    }

    pub(crate) fn name(&self) -> String {
        match self {
            Self::Contiguous => "contiguous".into(),
            Self::Runs(n) => format!("runs:{n}"),
            Self::Shuffled => "shuffled".into(),
        }
    }
}

/// The pages workload's layout: where each page sits (the same offset on both sides).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageLayout {
    pub(crate) layers: usize,
    pub(crate) pages: usize,
    pub(crate) page_size: usize,
}

impl PageLayout {
    pub(crate) fn of(args: &Args) -> Option<Self> {
        args.pages.map(|pages| Self {
            layers: args.layers,
            pages,
            page_size: args.page_size,
        })
    }

    /// Bytes from one layer's start to the next: its pages and a one-page gap.
    fn layer_stride(&self) -> Option<usize> {
        self.pages.checked_add(1)?.checked_mul(self.page_size)
    }

    /// Bytes of buffer the layout spans on each side.
    pub(crate) fn span(&self) -> Option<usize> {
        self.layer_stride()?.checked_mul(self.layers)
    }

    /// Every page's offset, in the order `order` submits them; `seed` picks the shuffle.
    pub(crate) fn offsets(&self, order: PageOrder, seed: u64) -> Vec<usize> {
        let stride = self.layer_stride().unwrap_or(0);
        let page = |layer: usize, page: usize| layer * stride + page * self.page_size;
        let mut random = SplitMix(seed);
        match order {
            PageOrder::Contiguous => (0..self.layers)
                .flat_map(|l| (0..self.pages).map(move |p| page(l, p)))
                .collect(),
            PageOrder::Shuffled => {
                let mut all = self.offsets(PageOrder::Contiguous, seed);
                random.shuffle(&mut all);
                all
            }
            PageOrder::Runs(n) => {
                let mut runs: Vec<(usize, usize)> = (0..self.layers)
                    .flat_map(|l| (0..self.pages).step_by(n).map(move |p| (l, p)))
                    .collect();
                random.shuffle(&mut runs);
                runs.into_iter()
                    .flat_map(|(l, first)| {
                        (first..(first + n).min(self.pages)).map(move |p| page(l, p))
                    })
                    .collect()
            }
        }
    }
}

/// A small, seeded generator (SplitMix64): the bench's shuffles repeat from run to run.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher–Yates.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// Where each thread's batches go.
pub(crate) enum Workload {
    /// `--block_size` blocks over the first `usable` bytes of the buffers.
    Blocks { block_size: usize, usable: usize },
    /// The pages workload: every page's offset, in submission order.
    Pages {
        offsets: Vec<usize>,
        page_size: usize,
    },
}

impl Workload {
    /// The workload `args` choose between a local buffer of `local_len` bytes and a remote one
    /// of `remote_len`, or why it does not fit.
    pub(crate) fn of(args: &Args, local_len: usize, remote_len: u64) -> Result<Self, String> {
        let usable = (local_len.min(remote_len as usize) / args.block_size) * args.block_size;
        if usable == 0 {
            return Err("the remote buffer is smaller than one block".into());
        }
        match PageLayout::of(args) {
            Some(layout) => {
                if layout.span().is_none_or(|span| span > remote_len as usize) {
                    return Err(format!(
                        "the remote buffer ({} bytes) is smaller than --layers × (--pages + 1) × \
                         --page_size",
                        remote_len
                    ));
                }
                Ok(Self::Pages {
                    offsets: layout.offsets(args.page_order, 0x5EED),
                    page_size: layout.page_size,
                })
            }
            None => Ok(Self::Blocks {
                block_size: args.block_size,
                usable,
            }),
        }
    }

    /// Bytes per request.
    pub(crate) fn request_len(&self) -> usize {
        match self {
            Self::Pages { page_size, .. } => *page_size,
            Self::Blocks { block_size, .. } => *block_size,
        }
    }

    /// The offsets (the same on both sides) of the requests of a thread's `round`th batch of
    /// `--batch_size`, with `--threads` threads taking turns.
    pub(crate) fn batch_offsets(
        &self,
        args: &Args,
        thread: usize,
        round: usize,
        offsets: &mut Vec<usize>,
    ) {
        offsets.clear();
        match self {
            Self::Pages { offsets: pages, .. } => {
                // The page list cut into batches, the threads taking them in turn.
                let batches = pages.len().div_ceil(args.batch_size);
                let batch = (thread + round * args.threads) % batches;
                let first = batch * args.batch_size;
                offsets
                    .extend_from_slice(&pages[first..(first + args.batch_size).min(pages.len())]);
            }
            Self::Blocks { block_size, usable } => {
                let blocks = usable / block_size;
                offsets.extend((0..args.batch_size).map(|i| {
                    let block =
                        (thread * args.batch_size + round * args.threads * args.batch_size + i)
                            % blocks;
                    block * block_size
                }));
            }
        }
    }
}

/// The byte every node keeps at offset `i` of its buffer when verifying.
pub(crate) fn expected_byte(offset: usize) -> u8 {
    let x = (offset as u64 / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (offset as u64 % 8);
    (x >> 56) as u8 ^ (offset as u8)
}

/// Fills a buffer with the pattern of [`expected_byte`].
pub(crate) fn fill_pattern(buffer: &OwnedBuffer) -> Result<(), String> {
    const CHUNK: usize = 1 << 20;
    let mut chunk = vec![0u8; CHUNK];
    let mut offset = 0;
    while offset < buffer.len() {
        let len = CHUNK.min(buffer.len() - offset);
        for (i, byte) in chunk[..len].iter_mut().enumerate() {
            *byte = expected_byte(offset + i);
        }
        buffer
            .write_at(offset, &chunk[..len])
            .map_err(|e| e.to_string())?;
        offset += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_orders_visit_every_page_once_and_runs_keep_their_pages_together() {
        let layout = PageLayout {
            layers: 3,
            pages: 10,
            page_size: 4096,
        };
        let stride = 11 * 4096;
        let mut every: Vec<usize> = (0..3)
            .flat_map(|l| (0..10).map(move |p| l * stride + p * 4096))
            .collect();
        assert_eq!(layout.offsets(PageOrder::Contiguous, 1), every);
        for order in [PageOrder::Shuffled, PageOrder::Runs(4)] {
            let mut offsets = layout.offsets(order, 1);
            assert_ne!(offsets, every, "{order:?} is not the contiguous order");
            offsets.sort_unstable();
            every.sort_unstable();
            assert_eq!(offsets, every, "{order:?}");
        }
        // Runs of 4 (the last of a layer shorter): within a run, consecutive pages.
        let runs = layout.offsets(PageOrder::Runs(4), 1);
        let mut at = 0;
        while at < runs.len() {
            let (layer, page) = (runs[at] / stride, runs[at] % stride / 4096);
            assert_eq!(page % 4, 0, "a run starts on a multiple of 4");
            let len = 4.min(10 - page);
            for k in 0..len {
                assert_eq!(runs[at + k], layer * stride + (page + k) * 4096);
            }
            at += len;
        }
    }
}
