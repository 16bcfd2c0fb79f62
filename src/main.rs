use mlx_rs::Array;
#[unsafe(no_mangle)]
pub extern "C" fn mach_approximate_time() -> u64 { 0 }
fn main() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
    let b = a.multiply(&a).unwrap();
    println!("{:?}", b);
}
