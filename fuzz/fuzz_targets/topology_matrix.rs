//! Mooncake's NIC priority matrix (`MC_CUSTOM_TOPO_JSON`, `--nic_priority_matrix`, and the
//! `priority_matrix` of peers' descriptors): `topology::parse_matrix`, then `candidates` for
//! every location. Properties: a matrix that reads writes back (`matrix_to_json`) to an equal
//! matrix; candidates are NICs of the node, never repeated, preferred before available, and
//! never empty while the node has a NIC.
#![cfg_attr(fuzzing, no_main)]

use std::collections::HashSet;

use tern_transport_rdma::topology::{candidates, matrix_to_json, parse_matrix};

tern_fuzz::target!(|data| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(matrix) = parse_matrix(text) else {
        return;
    };
    let json = matrix_to_json(&matrix);
    assert_eq!(parse_matrix(&json).as_ref(), Ok(&matrix), "round trip");
    let all: Vec<String> = ["rxe0", "rxe1", "mlx5_0"].map(str::to_owned).to_vec();
    let locations = matrix.keys().map(String::as_str).chain(["*", "cpu:9"]);
    for location in locations {
        let found = candidates(&matrix, location, &all);
        assert!(!found.is_empty());
        let mut seen = HashSet::new();
        for nic in found.preferred.iter().chain(&found.available) {
            assert!(all.contains(nic), "{nic:?} is not a NIC of this node");
            assert!(seen.insert(nic), "{nic:?} twice");
        }
    }
});
