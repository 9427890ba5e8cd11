//! Generates TEI's gRPC messages and service traits from the repository's
//! `proto/tei.proto`, and its encoded descriptors (`tei_descriptor.bin`)
//! that server reflection answers with. protox parses it in Rust, so
//! building needs no `protoc` on the machine.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = "../../proto";
    let file = format!("{dir}/tei.proto");
    println!("cargo:rerun-if-changed={file}");
    let descriptors = protox::compile([&file], [dir])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("tei_descriptor.bin"), descriptors.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
