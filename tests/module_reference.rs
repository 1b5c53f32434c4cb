//! docs/modules.md is the module reference generated from the module kinds' declarations: this test fails when the
//! file differs from what the declarations give now.

#[test]
fn docs_modules_md_is_generated_from_the_declarations() {
    let want = flexstack_core::reference::markdown(&flexstack_daemon::catalog().reference());
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/modules.md");
    let have = std::fs::read_to_string(path).unwrap_or_default();
    if have != want {
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(have.lines().count().min(want.lines().count()));
        panic!(
            "docs/modules.md is stale (first difference at line {}: {:?} instead of {:?}); regenerate it with\n\n    \
             cargo run -- module kinds --markdown > docs/modules.md\n",
            line + 1,
            have.lines().nth(line).unwrap_or(""),
            want.lines().nth(line).unwrap_or(""),
        );
    }
}
