//! Generates TEI's gRPC messages and service traits from the repository's
//! `proto/tei.proto`. protox parses it in Rust, so building needs no
//! `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = "../../proto";
    let file = format!("{dir}/tei.proto");
    println!("cargo:rerun-if-changed={file}");
    let descriptors = protox::compile([&file], [dir])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
