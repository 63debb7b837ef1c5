//! `gpufeed-lab`: the VM lab by hand. `prepare` downloads and builds what the tests boot,
//! `boot` runs a scenario script in a VM and prints what it reports, `kernels` lists the cache.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use gpufeed_lab::{Cache, Kernel, KernelName, Payload, Variant, Vm, VmSpec};

#[derive(Parser)]
#[command(
    name = "gpufeed-lab",
    about = "gpufeed's VM lab: Debian kernels under QEMU"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Download the kernels and build the root filesystems, images and initramfs the tests
    /// boot (all of them unless named); what is cached is reused.
    Prepare {
        /// bookworm (6.1), trixie (6.12), trixie-backports (newest); repeatable
        #[arg(long = "kernel")]
        kernels: Vec<KernelName>,
        /// minbase, systemd-trixie, systemd-bookworm, bench (only when named); repeatable
        #[arg(long = "variant")]
        variants: Vec<Variant>,
        /// look for newer kernel packages in the suites
        #[arg(long)]
        refresh: bool,
    },
    /// The cached kernels.
    Kernels,
    /// Boot a VM that runs SCRIPT (bash; `. /payload/lab.sh` gives it `report` and
    /// `lab_done`) and print every line it reports.
    Boot {
        #[arg(long, default_value = "trixie")]
        kernel: KernelName,
        #[arg(long, default_value = "minbase")]
        variant: Variant,
        /// boot with lockdown=confidentiality (as Talos with SecureBoot)
        #[arg(long)]
        lockdown: bool,
        /// the q35 machine (PCIe root ports)
        #[arg(long)]
        q35: bool,
        /// files for the payload disk: SRC:NAME (at /payload/NAME)
        #[arg(long = "copy", value_name = "SRC:NAME")]
        copies: Vec<String>,
        /// seconds the VM may live
        #[arg(long, default_value_t = 300)]
        deadline: u64,
        /// more kernel command-line arguments (`systemd.log_level=debug`)
        #[arg(long = "append")]
        append: Vec<String>,
        script: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let cache = Cache::open()?;
    match cli.cmd {
        Cmd::Prepare {
            kernels,
            variants,
            refresh,
        } => {
            let kernels = if kernels.is_empty() {
                KernelName::ALL.to_vec()
            } else {
                kernels
            };
            let variants = if variants.is_empty() {
                vec![
                    Variant::Minbase,
                    Variant::SystemdTrixie,
                    Variant::SystemdBookworm,
                ]
            } else {
                variants
            };
            let _lock = cache.lock()?;
            for k in kernels {
                let kernel = Kernel::prepare(&cache, k, refresh)?;
                gpufeed_lab::initramfs::prepare(&cache, &kernel)?;
                for v in &variants {
                    let img = v.image(&cache, &kernel)?;
                    println!("{k}\t{}\t{v}\t{}", kernel.release, img.display());
                }
            }
        }
        Cmd::Kernels => {
            for k in KernelName::ALL {
                match Kernel::cached(&cache, k)? {
                    Some(c) => println!("{k}\t{}\t{}\t{}", c.version, c.release, k.what()),
                    None => println!("{k}\t(not cached)\t\t{}", k.what()),
                }
            }
        }
        Cmd::Boot {
            kernel,
            variant,
            lockdown,
            q35,
            copies,
            deadline,
            append,
            script,
        } => {
            let text = std::fs::read_to_string(&script)
                .with_context(|| format!("read {}", script.display()))?;
            let payload = Payload::new(&text)?;
            for c in &copies {
                let (src, name) = c
                    .split_once(':')
                    .with_context(|| format!("--copy {c}: expected SRC:NAME"))?;
                payload.copy(src.as_ref(), name)?;
            }
            let mut spec = VmSpec::new(&cache, "boot", kernel, variant)?;
            spec.q35 = q35;
            spec.deadline = Duration::from_secs(deadline);
            if lockdown {
                spec.cmdline.push("lockdown=confidentiality".into());
            }
            spec.cmdline.extend(append);
            let mut vm = Vm::start(&cache, &spec, &payload.image()?)?;
            let mut shown = 0;
            loop {
                let r = vm.expect("done", Duration::from_millis(500));
                for l in &vm.port.seen[shown..] {
                    println!("{:6.1} {} {}", l.at.as_secs_f64(), l.key, l.value);
                }
                shown = vm.port.seen.len();
                match r {
                    Ok(_) => break,
                    Err(gpufeed_lab::Error::Vm { what, .. }) if what.starts_with("no done") => {
                        continue
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            vm.wait_exit(Duration::from_secs(60))?;
            eprintln!("lab: powered off after {:.1} s", vm.uptime().as_secs_f64());
        }
    }
    Ok(())
}
