//! Fleet simulation of global thresholds: `fleet_sim [--quick] [--seed N]` prints a markdown
//! table of the sweep (see `ratelimit_tests::fleet_sim`).

use std::time::Instant;

use ratelimit_tests::fleet_sim;

fn main() -> anyhow::Result<()> {
    let mut quick = false;
    let mut seed = 1u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--seed" => {
                seed = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--seed needs a value"))?
                    .parse()?
            }
            _ => anyhow::bail!("usage: fleet_sim [--quick] [--seed N]"),
        }
    }
    let set = if quick {
        fleet_sim::quick(seed)
    } else {
        fleet_sim::full(seed)
    };
    let t0 = Instant::now();
    let mut out = Vec::new();
    for sc in &set {
        let t = Instant::now();
        out.push(fleet_sim::run(sc));
        eprintln!(
            "{} N={} N_k={} Δ={}ms T={}s: {:.2}s",
            sc.name,
            sc.hosts,
            sc.hot_hosts,
            sc.sync_ms,
            sc.interval_s,
            t.elapsed().as_secs_f64()
        );
    }
    print!("{}", fleet_sim::table(&out));
    println!(
        "\n{} scenarios, seed {seed}, {:.1} s",
        out.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
