//! Segment descriptors as metadata stores and the P2P Metadata RPC hand them over:
//! `SegmentDesc::from_json`. Properties: a descriptor that reads passes `validate`, writes as
//! one line of JSON ending in a newline, and reads back equal; every buffer contains itself;
//! a remote-accessible buffer of an RDMA-family segment carries one rkey per device.
#![cfg_attr(fuzzing, no_main)]

use tern_metadata::SegmentDesc;

tern_fuzz::target!(|data| {
    let Ok(desc) = SegmentDesc::from_json(data) else {
        return;
    };
    assert_eq!(desc.validate(), Ok(()));
    let json = desc.to_json();
    assert!(json.ends_with('\n'));
    assert!(!json.trim_end().contains('\n'), "one line: {json:?}");
    let again = SegmentDesc::from_json(json.as_bytes()).expect("its own JSON reads back");
    assert_eq!(again, desc, "round trip");
    assert!(again.same_content(&desc));
    assert_eq!(again.to_json(), json, "writing is deterministic");
    assert!(!desc.name.is_empty() && !desc.protocols().is_empty());
    let keyed = ["rdma", "efa", "cxi"].iter().any(|p| desc.speaks(p));
    for buffer in &desc.buffers {
        assert!(buffer.contains(buffer.addr, buffer.length));
        assert!(!buffer.contains(buffer.addr, 0));
        assert!(desc.buffer_containing(buffer.addr, buffer.length).is_some());
        let rkeys = buffer.rkey.as_ref().map_or(0, Vec::len);
        if keyed && rkeys != 0 {
            assert_eq!(rkeys, desc.devices.len());
        }
    }
});
