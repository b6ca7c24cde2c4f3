//! The stable-toolchain harness: what a fuzz target's `main` runs when it is built without
//! cargo-fuzz. It replays the target's corpus, then feeds it random inputs and mutations of
//! the corpus until the time is up; it stops at the first panic, writes the input to the
//! target's artifacts directory and exits non-zero. It has no coverage feedback (libFuzzer's
//! is what finds deep bugs); it exists so that the targets still run where nightly or
//! cargo-fuzz cannot be had.
//!
//! It prints libFuzzer's final-stats lines (`stat::number_of_executed_units`,
//! `stat::average_exec_per_sec`) so that `cargo xtask fuzz` reads both harnesses alike. It must
//! not know any target: targets hand it their body.
//!
//! Usage of a target built this way: `<target> [--seconds N] [--runs N] [--seed N]
//! [--artifacts DIR] [CORPUS_DIR...]`; the corpus defaults to `fuzz/corpus/<target>` and the
//! artifacts to `fuzz/artifacts/<target>`.

use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Largest input the harness makes.
const MAX_LEN: usize = 64 * 1024;
/// Inputs kept to mutate from (seeds plus a sample of mutants).
const MAX_POOL: usize = 4096;

/// Bytes and tokens that matter to the formats under test: JSON, HTTP, the frame layouts.
const TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b":",
    b",",
    b"null",
    b"true",
    b"false",
    b"-1",
    b"0",
    b"1e999",
    b"18446744073709551616",
    b"\"\\u0000\"",
    b"\\ud800",
    b"{}",
    b"[]",
    b"\r\n",
    b"\r\n\r\n",
    b"Content-Length: ",
    b"?key=",
    b"&key=",
    b"%",
    b"%2F",
    b"HTTP/1.1 ",
    b"GET ",
    b"PUT ",
    b"@",
    b"rxe0",
    b"\"qp_num\":[",
    b"\"mtu\":",
    b"\"ready_ack\":true",
    b"\"rkey\":[",
    b"\"protocol\":\"rdma\"",
];

/// 64-bit values worth planting: limits, lengths, and the status magic.
const WORDS: &[u64] = &[
    0,
    1,
    2,
    8,
    9,
    24,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    i64::MAX as u64,
    1 << 63,
    u64::MAX,
    u64::MAX - 1,
    0x4D43_5456_0000_0000,
    0x4D43_5456_0000_0001,
];

/// Runs `body` as a fuzz target named `name` with the command-line arguments; see the module
/// docs. Returns failure (and has written an artifact) when the body panicked.
pub fn main(name: &str, body: impl Fn(&[u8])) -> ExitCode {
    match Options::parse(name, std::env::args().skip(1)) {
        Ok(options) => run(name, &options, &body),
        Err(message) => {
            eprintln!("{name}: {message}");
            ExitCode::from(2)
        }
    }
}

/// Command-line settings.
#[derive(Debug)]
struct Options {
    seconds: f64,
    runs: Option<u64>,
    seed: u64,
    artifacts: PathBuf,
    corpus: Vec<PathBuf>,
}

impl Options {
    fn parse(name: &str, args: impl Iterator<Item = String>) -> Result<Self, String> {
        let fuzz_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut options = Self {
            seconds: 10.0,
            runs: None,
            seed: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                ^ u64::from(std::process::id()),
            artifacts: fuzz_dir.join("artifacts").join(name),
            corpus: Vec::new(),
        };
        let mut args = args.peekable();
        while let Some(arg) = args.next() {
            let mut value = |flag: &str| args.next().ok_or_else(|| format!("{flag} needs a value"));
            match arg.as_str() {
                "--seconds" => {
                    options.seconds = value("--seconds")?
                        .parse()
                        .map_err(|_| "--seconds takes a number".to_owned())?;
                }
                "--runs" => {
                    options.runs = Some(
                        value("--runs")?
                            .parse()
                            .map_err(|_| "--runs takes a count".to_owned())?,
                    );
                }
                "--seed" => {
                    options.seed = value("--seed")?
                        .parse()
                        .map_err(|_| "--seed takes a number".to_owned())?;
                }
                "--artifacts" => options.artifacts = PathBuf::from(value("--artifacts")?),
                flag if flag.starts_with('-') => return Err(format!("unknown flag {flag}")),
                dir => options.corpus.push(PathBuf::from(dir)),
            }
        }
        if options.corpus.is_empty() {
            options.corpus.push(fuzz_dir.join("corpus").join(name));
        }
        Ok(options)
    }
}

fn run(name: &str, options: &Options, body: &dyn Fn(&[u8])) -> ExitCode {
    let mut pool = load_corpus(&options.corpus);
    let seeds = pool.len();
    if pool.is_empty() {
        pool.push(Vec::new());
    }
    println!(
        "{name}: stable harness (random and mutated seed inputs, no coverage feedback), {seeds} seed inputs, seed {}",
        options.seed
    );
    let mut rng = Rng::new(options.seed);
    let started = Instant::now();
    let budget = Duration::from_secs_f64(options.seconds.max(0.0));
    let mut executed = 0u64;
    // Every seed once, then mutants until the time or the run count is spent.
    let mut replay = pool.clone().into_iter();
    loop {
        let input = match replay.next() {
            Some(seed) => seed,
            None => {
                if started.elapsed() >= budget || options.runs.is_some_and(|r| executed >= r) {
                    break;
                }
                let input = next_input(&mut rng, &pool);
                if pool.len() < MAX_POOL && rng.below(64) == 0 {
                    pool.push(input.clone());
                }
                input
            }
        };
        executed += 1;
        if panic::catch_unwind(AssertUnwindSafe(|| body(&input))).is_err() {
            let path = write_artifact(&options.artifacts, &input);
            match &path {
                Ok(path) => println!("{name}: crash; Test unit written to {}", path.display()),
                Err(e) => println!("{name}: crash; the input could not be written: {e}"),
            }
            print_stats(executed, started.elapsed());
            return ExitCode::FAILURE;
        }
    }
    print_stats(executed, started.elapsed());
    ExitCode::SUCCESS
}

fn print_stats(executed: u64, elapsed: Duration) {
    let secs = elapsed.as_secs_f64().max(1e-9);
    println!("stat::number_of_executed_units: {executed}");
    println!(
        "stat::average_exec_per_sec:   {}",
        (executed as f64 / secs) as u64
    );
}

/// Every regular file in the corpus directories, in name order (missing directories are
/// empty).
fn load_corpus(dirs: &[PathBuf]) -> Vec<Vec<u8>> {
    let mut inputs = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        paths.sort();
        inputs.extend(paths.iter().filter_map(|p| std::fs::read(p).ok()));
    }
    inputs
}

/// Writes a crashing input as `crash-<hash>` (libFuzzer's naming) and returns its path.
fn write_artifact(dir: &Path, input: &[u8]) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    // FNV-1a: a stable name, so the same crash is written once.
    let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let path = dir.join(format!("crash-{hash:016x}"));
    std::fs::write(&path, input)?;
    Ok(path)
}

/// One new input: fresh random bytes now and then, else one to four mutations of a pool
/// entry.
fn next_input(rng: &mut Rng, pool: &[Vec<u8>]) -> Vec<u8> {
    if rng.below(10) == 0 {
        let len = rng.below(256) as usize;
        return (0..len).map(|_| rng.byte()).collect();
    }
    let mut input = pool[rng.below(pool.len() as u64) as usize].clone();
    for _ in 0..=rng.below(4) {
        mutate(rng, &mut input, pool);
    }
    input.truncate(MAX_LEN);
    input
}

fn mutate(rng: &mut Rng, input: &mut Vec<u8>, pool: &[Vec<u8>]) {
    let len = input.len();
    let at = |rng: &mut Rng| rng.below(len as u64 + 1) as usize;
    match rng.below(9) {
        // Flip a bit.
        0 if len > 0 => {
            let i = rng.below(len as u64) as usize;
            input[i] ^= 1 << rng.below(8);
        }
        // Replace a byte.
        1 if len > 0 => {
            let i = rng.below(len as u64) as usize;
            input[i] = rng.byte();
        }
        // Insert random bytes.
        2 => {
            let i = at(rng);
            let n = 1 + rng.below(16) as usize;
            let bytes: Vec<u8> = (0..n).map(|_| rng.byte()).collect();
            input.splice(i..i, bytes);
        }
        // Delete a range.
        3 if len > 0 => {
            let i = rng.below(len as u64) as usize;
            let n = 1 + rng.below((len - i).min(32) as u64) as usize;
            input.drain(i..i + n);
        }
        // Duplicate a range.
        4 if len > 0 => {
            let i = rng.below(len as u64) as usize;
            let n = 1 + rng.below((len - i).min(64) as u64) as usize;
            let copy = input[i..i + n].to_vec();
            let to = at(rng);
            input.splice(to..to, copy);
        }
        // Insert a token of the formats under test.
        5 => {
            let token = TOKENS[rng.below(TOKENS.len() as u64) as usize];
            let i = at(rng);
            input.splice(i..i, token.iter().copied());
        }
        // Overwrite eight bytes with an interesting little-endian word.
        6 => {
            let word = WORDS[rng.below(WORDS.len() as u64) as usize].to_le_bytes();
            let i = at(rng);
            let end = (i + 8).min(len);
            input.splice(i..end, word);
        }
        // Splice in part of another input.
        7 => {
            let other = &pool[rng.below(pool.len() as u64) as usize];
            if !other.is_empty() {
                let from = rng.below(other.len() as u64) as usize;
                let n = 1 + rng.below((other.len() - from) as u64) as usize;
                let i = at(rng);
                let end = (i + n).min(len);
                input.splice(i..end, other[from..from + n].iter().copied());
            }
        }
        // Cut the tail.
        _ => {
            let i = at(rng);
            input.truncate(i);
        }
    }
}

/// xorshift64*: small, fast, and reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform enough in `0..n`; 0 when `n` is 0.
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutants_stay_within_the_length_bound_and_vary() {
        let pool = vec![b"{\"a\":1}".to_vec(), vec![0u8; 40]];
        let mut rng = Rng::new(7);
        let mut distinct = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let input = next_input(&mut rng, &pool);
            assert!(input.len() <= MAX_LEN);
            distinct.insert(input);
        }
        assert!(distinct.len() > 5_000, "only {} distinct", distinct.len());
    }

    #[test]
    fn options_default_to_the_targets_corpus_and_take_flags() {
        let args = ["--seconds", "2.5", "--runs", "7", "--seed", "9", "/tmp/c"];
        let options = Options::parse("x", args.iter().map(|s| (*s).to_owned())).unwrap();
        assert_eq!(options.seconds, 2.5);
        assert_eq!(options.runs, Some(7));
        assert_eq!(options.seed, 9);
        assert_eq!(options.corpus, vec![PathBuf::from("/tmp/c")]);
        assert!(options.artifacts.ends_with("artifacts/x"));
        let defaults = Options::parse("y", std::iter::empty()).unwrap();
        assert!(defaults.corpus[0].ends_with("corpus/y"));
        assert!(Options::parse("z", ["--bogus".to_owned()].into_iter()).is_err());
        assert!(Options::parse("z", ["--seconds".to_owned()].into_iter()).is_err());
    }

    #[test]
    fn a_panicking_body_leaves_an_artifact_and_fails() {
        let dir = std::env::temp_dir().join(format!("tern-fuzz-test-{}", std::process::id()));
        let options = Options {
            seconds: 5.0,
            runs: Some(100_000),
            seed: 3,
            artifacts: dir.clone(),
            corpus: Vec::new(),
        };
        let outcome = run("t", &options, &|data: &[u8]| {
            assert!(!data.contains(&b'{'), "found a brace");
        });
        assert_eq!(outcome, ExitCode::FAILURE);
        let written: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(written.len(), 1);
        let path = written[0].as_ref().unwrap().path();
        assert!(std::fs::read(&path).unwrap().contains(&b'{'));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
