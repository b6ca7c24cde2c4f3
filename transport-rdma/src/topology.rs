//! NIC topology: which NUMA node each NIC sits on, and Mooncake's priority matrix
//! (`{"cpu:0": [["mlx5_0"], ["mlx5_1"]], ...}`: per storage type, the preferred NICs and the
//! other usable ones) — parsing, writing, building it from sysfs facts, and resolving a
//! buffer's location to candidate NICs.
//!
//! Its only I/O is reading a few small sysfs files under a root the caller passes (normally
//! `/sys`, a fake tree in tests). It must not open devices or call verbs, and it must not
//! choose among candidates (retry and striping policy belong to the transport).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tern_metadata::PriorityMatrix;

/// A NIC and where it sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicInfo {
    /// The RDMA device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its NUMA node; `None` when the kernel does not know (Soft-RoCE, single-node VMs).
    pub numa_node: Option<u32>,
}

/// Why a priority matrix could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The text is not JSON, or not a JSON object. Fix the matrix (the reason says where it
    /// breaks); its shape is `{"cpu:0": [["nic", ...], ["nic", ...]], ...}`.
    #[error("malformed priority matrix JSON: {reason}")]
    MalformedJson {
        /// What the parser found.
        reason: String,
    },
    /// The value of one storage type is not an array of exactly two arrays of NIC names
    /// (Mooncake refuses such a matrix too). Fix that entry.
    #[error("priority matrix entry {key:?} is not [[preferred NICs], [available NICs]]: {reason}")]
    MalformedEntry {
        /// The storage type whose value is wrong.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A matrix file could not be read. Check the path (`MC_CUSTOM_TOPO_JSON`) and its
    /// permissions.
    #[error("cannot read priority matrix file {path}: {reason}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        reason: String,
    },
}

/// Reads a priority matrix with Mooncake's rules: a JSON object whose every value is an array
/// of exactly two arrays of strings.
pub fn parse_matrix(json: &str) -> Result<PriorityMatrix, TopologyError> {
    let root: Value = serde_json::from_str(json).map_err(|e| TopologyError::MalformedJson {
        reason: e.to_string(),
    })?;
    let Value::Object(entries) = root else {
        return Err(TopologyError::MalformedJson {
            reason: format!("expected an object, found {}", kind_of(&root)),
        });
    };
    let mut matrix = PriorityMatrix::new();
    for (key, value) in entries {
        let lists = parse_entry(&value).map_err(|reason| TopologyError::MalformedEntry {
            key: key.clone(),
            reason,
        })?;
        matrix.insert(key, lists);
    }
    Ok(matrix)
}

fn parse_entry(value: &Value) -> Result<[Vec<String>; 2], String> {
    let Value::Array(lists) = value else {
        return Err(format!("found {}", kind_of(value)));
    };
    let [preferred, available] = lists.as_slice() else {
        return Err(format!("found an array of {} items", lists.len()));
    };
    Ok([
        parse_names(preferred, "preferred")?,
        parse_names(available, "available")?,
    ])
}

fn parse_names(value: &Value, which: &str) -> Result<Vec<String>, String> {
    let Value::Array(items) = value else {
        return Err(format!("the {which} list is {}", kind_of(value)));
    };
    items
        .iter()
        .map(|item| match item {
            Value::String(name) => Ok(name.clone()),
            other => Err(format!(
                "the {which} list holds {}, not a NIC name",
                kind_of(other)
            )),
        })
        .collect()
}

fn kind_of(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("a boolean ({b})"),
        Value::Number(n) => format!("a number ({n})"),
        Value::String(s) => format!("a string ({s:?})"),
        Value::Array(_) => "an array".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

/// Reads a matrix file (the format of `MC_CUSTOM_TOPO_JSON`) with [`parse_matrix`]'s rules.
pub fn read_matrix_file(path: &Path) -> Result<PriorityMatrix, TopologyError> {
    let text = std::fs::read_to_string(path).map_err(|e| TopologyError::Unreadable {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    parse_matrix(&text)
}

/// Writes a matrix as Mooncake does: compact, keys sorted.
pub fn matrix_to_json(m: &PriorityMatrix) -> String {
    // A map of strings to lists of strings always serializes; the fallback is unreachable.
    serde_json::to_string(m).unwrap_or_else(|_| "{}".to_owned())
}

/// Mooncake's discovered matrix: `cpu:<n>` for every NUMA node, preferring the NICs on that
/// node (and those whose node is unknown, since they may be anywhere), with the rest
/// available. With no NUMA nodes known, `cpu:0` prefers every NIC. NIC order follows `nics`.
pub fn build_matrix(nics: &[NicInfo], numa_nodes: &[u32]) -> PriorityMatrix {
    let mut seen = HashSet::new();
    let nics: Vec<&NicInfo> = nics.iter().filter(|n| seen.insert(&n.name)).collect();
    let mut matrix = PriorityMatrix::new();
    if numa_nodes.is_empty() {
        let every = nics.iter().map(|n| n.name.clone()).collect();
        matrix.insert("cpu:0".to_owned(), [every, Vec::new()]);
        return matrix;
    }
    for &node in numa_nodes {
        let (preferred, available): (Vec<&NicInfo>, Vec<&NicInfo>) = nics
            .iter()
            .partition(|n| n.numa_node.is_none_or(|nic_node| nic_node == node));
        matrix.insert(
            format!("cpu:{node}"),
            [names_of(&preferred), names_of(&available)],
        );
    }
    matrix
}

fn names_of(nics: &[&NicInfo]) -> Vec<String> {
    nics.iter().map(|n| n.name.clone()).collect()
}

/// The matrix with every NIC name not in `allowed` dropped; entries stay (even if emptied)
/// and the remaining names keep their order.
pub fn restrict(m: &PriorityMatrix, allowed: &[String]) -> PriorityMatrix {
    let keep = |names: &[String]| -> Vec<String> {
        names
            .iter()
            .filter(|name| allowed.contains(name))
            .cloned()
            .collect()
    };
    m.iter()
        .map(|(key, [preferred, available])| (key.clone(), [keep(preferred), keep(available)]))
        .collect()
}

/// The NICs that may serve one buffer location.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Candidates {
    /// Try these first.
    pub preferred: Vec<String>,
    /// Usable when the preferred ones fail or are busy.
    pub available: Vec<String>,
}

impl Candidates {
    /// Whether no NIC can serve the location.
    pub fn is_empty(&self) -> bool {
        self.preferred.is_empty() && self.available.is_empty()
    }
}

/// Resolves `location` (`cpu:0`, `cuda:1`, `*`) the way Mooncake does: the matrix's entry
/// for exactly that key; if there is none, or none of its NICs is in `all_nics`, the implicit
/// `"*"` entry that prefers every NIC in `all_nics`. Names not in `all_nics` are dropped, as
/// are repeats (a NIC listed as preferred is not also available).
pub fn candidates(m: &PriorityMatrix, location: &str, all_nics: &[String]) -> Candidates {
    if let Some([preferred, available]) = m.get(location) {
        let mut seen = HashSet::new();
        let found = Candidates {
            preferred: usable_names(preferred, all_nics, &mut seen),
            available: usable_names(available, all_nics, &mut seen),
        };
        if !found.is_empty() {
            return found;
        }
    }
    let mut seen = HashSet::new();
    Candidates {
        preferred: all_nics
            .iter()
            .filter(|name| seen.insert(name.as_str()))
            .cloned()
            .collect(),
        available: Vec::new(),
    }
}

/// `names` that are in `all_nics` and not yet in `seen`, in order.
fn usable_names<'a>(
    names: &'a [String],
    all_nics: &[String],
    seen: &mut HashSet<&'a str>,
) -> Vec<String> {
    names
        .iter()
        .filter(|name| all_nics.contains(name) && seen.insert(name.as_str()))
        .cloned()
        .collect()
}

/// A device name safe to join onto a sysfs path: no separators, no `.`/`..`.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/')
}

/// The NUMA node of `nic` from `<sysfs>/class/infiniband/<nic>/device/numa_node`; `None`
/// when the file is missing, unreadable or says -1.
pub fn numa_node_of_nic(sysfs: &Path, nic: &str) -> Option<u32> {
    if !is_plain_name(nic) {
        return None;
    }
    let path = sysfs
        .join("class/infiniband")
        .join(nic)
        .join("device/numa_node");
    let text = std::fs::read_to_string(path).ok()?;
    // Parsed as signed so that the kernel's -1 ("no node") is recognised rather than garbage.
    let node: i64 = text.trim().parse().ok()?;
    u32::try_from(node).ok()
}

/// The NUMA nodes, from the `node<N>` directories under `<sysfs>/devices/system/node`,
/// sorted; empty when the directory is missing (no NUMA support).
pub fn numa_nodes(sysfs: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(sysfs.join("devices/system/node")) else {
        return Vec::new();
    };
    let mut nodes: Vec<u32> = entries
        .filter_map(Result::ok)
        .filter(|entry| entry.path().is_dir())
        .filter_map(|entry| {
            let name = entry.file_name();
            name.to_str()?.strip_prefix("node")?.parse().ok()
        })
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// The CPUs of NUMA node `node`, from `<sysfs>/devices/system/node/node<N>/cpulist`; empty
/// when the file is missing.
pub fn node_cpus(sysfs: &Path, node: u32) -> Vec<usize> {
    let path = sysfs
        .join("devices/system/node")
        .join(format!("node{node}"))
        .join("cpulist");
    std::fs::read_to_string(path)
        .map(|text| parse_cpu_list(&text))
        .unwrap_or_default()
}

/// More CPUs than any kernel supports (`NR_CPUS` tops out at 8192); bounds the work a corrupt
/// range like `0-4294967295` can cause.
const MAX_CPUS: usize = 1 << 16;

/// Parses the kernel's CPU list format (`"0-3,8,10-11"`) into sorted, distinct CPU numbers.
/// Items that do not parse, reversed ranges and CPUs at or above 65 536 are skipped.
pub fn parse_cpu_list(text: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for item in text.trim().split(',').map(str::trim) {
        let range = match item.split_once('-') {
            Some((first, last)) => first
                .trim()
                .parse::<usize>()
                .ok()
                .zip(last.trim().parse().ok()),
            None => item.parse::<usize>().ok().map(|cpu| (cpu, cpu)),
        };
        if let Some((first, last)) = range
            && first <= last
            && last < MAX_CPUS
        {
            cpus.extend(first..=last);
        }
        if cpus.len() > MAX_CPUS {
            break;
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    cpus
}

/// Splits a device list (`"rxe0, rxe1"`, `"rxe0,rxe1"`, `"rxe0 rxe1"`) into names, dropping
/// empty items and repeats.
pub fn parse_device_list(list: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for name in list
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|name| !name.is_empty())
    {
        if !names.iter().any(|seen| seen == name) {
            names.push(name.to_owned());
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn nic(name: &str, numa_node: Option<u32>) -> NicInfo {
        NicInfo {
            name: name.to_owned(),
            numa_node,
        }
    }

    /// A scratch directory for a fake sysfs tree, removed on drop.
    struct FakeSysfs(PathBuf);

    impl FakeSysfs {
        fn new(test: &str) -> Self {
            let root = std::env::temp_dir().join(format!(
                "tern-topology-{test}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            std::fs::create_dir_all(&root).unwrap();
            Self(root)
        }

        fn write(&self, relative: &str, contents: &str) {
            let path = self.0.join(relative);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, contents).unwrap();
        }

        fn mkdir(&self, relative: &str) {
            std::fs::create_dir_all(self.0.join(relative)).unwrap();
        }
    }

    impl Drop for FakeSysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn parses_and_rewrites_the_recorded_matrix() {
        let segment: Value =
            serde_json::from_str(include_str!("../tests/golden/mooncake-rdma-segment.json"))
                .unwrap();
        let recorded = segment["priority_matrix"].to_string();
        let matrix = parse_matrix(&recorded).unwrap();
        assert_eq!(matrix.len(), 5);
        assert_eq!(matrix["cpu:1"], [names(&["rxe0"]), vec![]]);
        assert_eq!(matrix_to_json(&matrix), recorded);
    }

    #[test]
    fn writes_compact_sorted_json() {
        let mut matrix = PriorityMatrix::new();
        matrix.insert("cpu:1".into(), [names(&["b"]), names(&["a"])]);
        matrix.insert("cpu:0".into(), [names(&["a"]), names(&["b"])]);
        assert_eq!(
            matrix_to_json(&matrix),
            r#"{"cpu:0":[["a"],["b"]],"cpu:1":[["b"],["a"]]}"#
        );
        assert_eq!(parse_matrix(&matrix_to_json(&matrix)).unwrap(), matrix);
    }

    #[test]
    fn rejects_what_is_not_an_object() {
        for text in ["", "[]", "\"cpu:0\"", "{", "null"] {
            assert!(
                matches!(parse_matrix(text), Err(TopologyError::MalformedJson { .. })),
                "{text:?}"
            );
        }
        assert_eq!(parse_matrix("{}").unwrap(), PriorityMatrix::new());
    }

    #[test]
    fn rejects_entries_that_are_not_two_lists_naming_the_key() {
        let cases = [
            (
                r#"{"cpu:0":[["a"],[]],"cuda:0":[["a"]]}"#,
                "cuda:0",
                "1 items",
            ),
            (r#"{"cpu:0":[[],[],[]]}"#, "cpu:0", "3 items"),
            (r#"{"cpu:0":"a"}"#, "cpu:0", "a string"),
            (
                r#"{"cpu:0":[["a"],"b"]}"#,
                "cpu:0",
                "available list is a string",
            ),
            (
                r#"{"cpu:0":[[1],[]]}"#,
                "cpu:0",
                "preferred list holds a number",
            ),
            (r#"{"cpu:0":[null,[]]}"#, "cpu:0", "preferred list is null"),
        ];
        for (text, key, needle) in cases {
            match parse_matrix(text) {
                Err(TopologyError::MalformedEntry { key: got, reason }) => {
                    assert_eq!(got, key, "{text}");
                    assert!(reason.contains(needle), "{reason:?} lacks {needle:?}");
                    let shown = TopologyError::MalformedEntry { key: got, reason }.to_string();
                    assert!(shown.contains(key), "{shown}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn builds_a_matrix_per_numa_node() {
        let nics = [
            nic("mlx5_0", Some(0)),
            nic("mlx5_1", Some(1)),
            nic("rxe0", None),
            nic("mlx5_2", Some(0)),
        ];
        let matrix = build_matrix(&nics, &[0, 1]);
        assert_eq!(matrix.len(), 2);
        assert_eq!(
            matrix["cpu:0"],
            [names(&["mlx5_0", "rxe0", "mlx5_2"]), names(&["mlx5_1"])]
        );
        assert_eq!(
            matrix["cpu:1"],
            [names(&["mlx5_1", "rxe0"]), names(&["mlx5_0", "mlx5_2"])]
        );
    }

    #[test]
    fn builds_cpu0_with_every_nic_when_no_node_is_known() {
        let nics = [nic("b", Some(3)), nic("a", None), nic("b", Some(3))];
        let matrix = build_matrix(&nics, &[]);
        assert_eq!(matrix.len(), 1);
        assert_eq!(matrix["cpu:0"], [names(&["b", "a"]), vec![]]);
    }

    #[test]
    fn matches_the_recorded_shape_for_a_nic_of_unknown_node() {
        let matrix = build_matrix(&[nic("rxe0", None)], &[0, 1]);
        assert_eq!(
            matrix_to_json(&matrix),
            r#"{"cpu:0":[["rxe0"],[]],"cpu:1":[["rxe0"],[]]}"#
        );
    }

    #[test]
    fn restrict_drops_names_and_keeps_entries() {
        let matrix =
            parse_matrix(r#"{"cpu:0":[["a","b"],["c"]],"cpu:1":[["c"],["b","a"]]}"#).unwrap();
        let restricted = restrict(&matrix, &names(&["a", "b"]));
        assert_eq!(restricted["cpu:0"], [names(&["a", "b"]), vec![]]);
        assert_eq!(restricted["cpu:1"], [vec![], names(&["b", "a"])]);
        let none = restrict(&matrix, &[]);
        assert_eq!(none.len(), 2);
        assert!(none.values().all(|[p, a]| p.is_empty() && a.is_empty()));
    }

    #[test]
    fn candidates_use_the_exact_key() {
        let matrix =
            parse_matrix(r#"{"cpu:0":[["a","ghost","a"],["b","a","c"]],"cpu:1":[["b"],["a"]]}"#)
                .unwrap();
        let all = names(&["a", "b", "c"]);
        assert_eq!(
            candidates(&matrix, "cpu:0", &all),
            Candidates {
                preferred: names(&["a"]),
                available: names(&["b", "c"]),
            }
        );
        assert_eq!(
            candidates(&matrix, "cpu:1", &all),
            Candidates {
                preferred: names(&["b"]),
                available: names(&["a"]),
            }
        );
    }

    #[test]
    fn candidates_fall_back_to_every_nic() {
        let matrix = parse_matrix(r#"{"cpu:0":[["ghost"],[]],"cpu:1":[["a"],[]]}"#).unwrap();
        let all = names(&["a", "b", "a"]);
        let every = Candidates {
            preferred: names(&["a", "b"]),
            available: vec![],
        };
        assert_eq!(candidates(&matrix, "cuda:0", &all), every);
        assert_eq!(candidates(&matrix, "*", &all), every);
        // An entry none of whose NICs exists falls back too.
        assert_eq!(candidates(&matrix, "cpu:0", &all), every);
        assert!(candidates(&matrix, "cpu:0", &[]).is_empty());
    }

    #[test]
    fn candidates_keep_an_entry_with_only_available_nics() {
        let matrix = parse_matrix(r#"{"cpu:0":[[],["b"]]}"#).unwrap();
        assert_eq!(
            candidates(&matrix, "cpu:0", &names(&["a", "b"])),
            Candidates {
                preferred: vec![],
                available: names(&["b"]),
            }
        );
    }

    #[test]
    fn reads_numa_facts_from_sysfs() {
        let sysfs = FakeSysfs::new("numa");
        sysfs.write("class/infiniband/mlx5_0/device/numa_node", "1\n");
        sysfs.write("class/infiniband/rxe0/device/numa_node", "-1\n");
        sysfs.write("class/infiniband/bad/device/numa_node", "one\n");
        sysfs.mkdir("devices/system/node/node1");
        sysfs.mkdir("devices/system/node/node0");
        sysfs.mkdir("devices/system/node/node10");
        sysfs.mkdir("devices/system/node/power");
        sysfs.write("devices/system/node/node2", "a file, not a node");
        sysfs.write("devices/system/node/node0/cpulist", "0-3,8,10-11\n");

        assert_eq!(numa_node_of_nic(&sysfs.0, "mlx5_0"), Some(1));
        assert_eq!(numa_node_of_nic(&sysfs.0, "rxe0"), None);
        assert_eq!(numa_node_of_nic(&sysfs.0, "bad"), None);
        assert_eq!(numa_node_of_nic(&sysfs.0, "missing"), None);
        assert_eq!(
            numa_node_of_nic(&sysfs.0, "../../class/infiniband/mlx5_0"),
            None
        );
        assert_eq!(numa_nodes(&sysfs.0), vec![0, 1, 10]);
        assert_eq!(node_cpus(&sysfs.0, 0), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(node_cpus(&sysfs.0, 1), Vec::<usize>::new());
    }

    #[test]
    fn missing_sysfs_means_no_nodes() {
        let sysfs = FakeSysfs::new("empty");
        assert!(numa_nodes(&sysfs.0).is_empty());
        assert!(numa_nodes(&sysfs.0.join("nowhere")).is_empty());
    }

    #[test]
    fn reads_matrix_files() {
        let dir = FakeSysfs::new("matrix-file");
        dir.write("topo.json", "{\"cpu:0\":[[\"a\"],[]]}\n");
        let matrix = read_matrix_file(&dir.0.join("topo.json")).unwrap();
        assert_eq!(matrix["cpu:0"], [names(&["a"]), vec![]]);
        let missing = dir.0.join("missing.json");
        match read_matrix_file(&missing) {
            Err(TopologyError::Unreadable { path, .. }) => assert_eq!(path, missing),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parses_cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("5"), vec![5]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("3-1,x,2-,7, 4 - 5 ,7"), vec![4, 5, 7]);
        assert_eq!(
            parse_cpu_list("0-18446744073709551615"),
            Vec::<usize>::new()
        );
        assert_eq!(parse_cpu_list("65534-65535,0-65535").len(), 65_536);
    }

    #[test]
    fn parses_device_lists() {
        assert_eq!(parse_device_list("rxe0, rxe1"), names(&["rxe0", "rxe1"]));
        assert_eq!(parse_device_list("rxe0,rxe1"), names(&["rxe0", "rxe1"]));
        assert_eq!(
            parse_device_list(" ,rxe1,,rxe0 rxe1,\n"),
            names(&["rxe1", "rxe0"])
        );
        assert!(parse_device_list("").is_empty());
        assert!(parse_device_list(" , ").is_empty());
    }
}
