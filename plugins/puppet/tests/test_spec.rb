# frozen_string_literal: true

require 'minitest/autorun'
require_relative '../lib/puppet_x/vmhost/spec'

# Normalisation, comparison and spec building: what makes a rerun change nothing.
class TestSpec < Minitest::Test
  Spec = PuppetX::Vmhost::Spec

  def test_memory_units
    assert_equal 256, Spec.memory_mib(256)
    assert_equal 256, Spec.memory_mib('256')
    assert_equal 256, Spec.memory_mib('256M')
    assert_equal 256, Spec.memory_mib('256MiB')
    assert_equal 2048, Spec.memory_mib('2G')
    assert_equal 2048, Spec.memory_mib('2gib')
    assert_nil Spec.memory_mib('2GB')
    assert_nil Spec.memory_mib('lots')
    assert_nil Spec.memory_mib(1.5)
  end

  def test_normalize_drops_what_the_daemon_leaves_out
    declared = { 'network' => 'lan', 'vlan' => '10', 'mac' => nil,
                 'ipv4' => { 'mode' => 'static', 'address' => '10.0.0.5/24', 'dns' => [], 'search' => [] } }
    assert_equal({ 'network' => 'lan', 'vlan' => 10, 'ipv4' => { 'mode' => 'static', 'address' => '10.0.0.5/24' } },
                 Spec.normalize(declared))
  end

  def test_normalize_keeps_strings_that_are_not_integer_members
    assert_equal({ 'cmdline' => '42', 'disk_gib' => 4 }, Spec.normalize({ cmdline: '42', disk_gib: '4' }))
    assert_equal({ 'cmdline' => '' }, Spec.normalize({ 'cmdline' => '' }))
  end

  def test_hardware_normalisation
    assert_equal({ 'sfp' => [5, 6] }, Spec.normalize_hardware({ 'sfp' => %w[5 6], 'disk' => [] }))
    assert_equal({ 'copper' => [1] }, Spec.normalize_hardware({ copper: [1] }))
  end

  def test_same_compares_after_normalisation
    assert Spec.same?(:hardware, {}, { 'sfp' => [] })
    assert Spec.same?(:hardware, { 'sfp' => [5] }, { 'sfp' => ['5'], 'disk' => [] })
    refute Spec.same?(:hardware, { 'sfp' => [5, 6] }, { 'sfp' => [6, 5] })
    assert Spec.same?(:nics, [], [])
    assert Spec.same?(:nics, :absent, [])
    refute Spec.same?(:nics, [], [{ 'network' => 'lan' }])
    assert Spec.same?(:guest_interfaces,
                      [{ 'name' => 'eth0.20', 'link' => 'eth0', 'vlan_id' => 20, 'address' => '10.20.0.5/24' }],
                      [{ 'name' => 'eth0.20', 'link' => 'eth0', 'vlan_id' => '20', 'address' => '10.20.0.5/24' }])
    assert Spec.same?(:boot, { 'image' => 'b.qcow2', 'disk_gib' => 2 }, { 'image' => 'b.qcow2', 'disk_gib' => '2' })
    refute Spec.same?(:boot, { 'kernel' => '/k', 'cmdline' => 'quiet' }, { 'kernel' => '/k' })
  end

  def test_attribute_value_gives_empty_shapes_for_left_out_members
    spec = { 'name' => 'a', 'cpu' => 1, 'memory_mib' => 256, 'state' => 'running', 'boot' => { 'kernel' => '/k' } }
    assert_equal 1, Spec.attribute_value(spec, :cpu)
    assert_equal 256, Spec.attribute_value(spec, :memory)
    assert_equal :absent, Spec.attribute_value(spec, :role)
    assert_equal({}, Spec.attribute_value(spec, :hardware))
    assert_equal [], Spec.attribute_value(spec, :nics)
    assert_equal [], Spec.attribute_value(spec, :pci)
    assert_equal [], Spec.attribute_value(spec, :guest_interfaces)
  end

  def test_build_puts_declared_attributes_over_the_recorded_spec
    recorded = { 'name' => 'a', 'role' => 'web', 'cpu' => 1, 'memory_mib' => 256, 'state' => 'running',
                 'boot' => { 'kernel' => '/k' }, 'nics' => [{ 'network' => 'lan' }] }
    spec = Spec.build('a', recorded, { cpu: 2, memory: 512 }, 'running')
    assert_equal({ 'name' => 'a', 'role' => 'web', 'cpu' => 2, 'memory_mib' => 512, 'state' => 'running',
                   'boot' => { 'kernel' => '/k' }, 'nics' => [{ 'network' => 'lan' }] }, spec)
  end

  def test_build_for_a_new_vm
    spec = Spec.build('b', nil, { cpu: 1, memory: 256, boot: { 'kernel' => '/k' }, nics: [], hardware: {} }, nil)
    assert_equal({ 'name' => 'b', 'cpu' => 1, 'memory_mib' => 256, 'boot' => { 'kernel' => '/k' } }, spec)
    assert_equal 'stopped', Spec.build('b', nil, { cpu: 1 }, 'stopped')['state']
  end

  def test_build_clears_a_list_declared_empty
    recorded = { 'name' => 'a', 'cpu' => 1, 'memory_mib' => 256, 'state' => 'stopped', 'boot' => { 'kernel' => '/k' },
                 'guest_interfaces' => [{ 'name' => 'd0', 'address' => '10.9.0.1/24' }] }
    spec = Spec.build('a', recorded, { guest_interfaces: [] }, 'stopped')
    refute spec.key?('guest_interfaces')
    assert_equal 'stopped', spec['state']
  end

  def test_build_keeps_the_recorded_state_when_none_is_given
    recorded = { 'name' => 'a', 'cpu' => 1, 'memory_mib' => 256, 'state' => 'stopped', 'boot' => { 'kernel' => '/k' } }
    assert_equal 'stopped', Spec.build('a', recorded, {}, nil)['state']
  end

  def test_drift_names_the_differing_members_as_vmhostd_does
    old = { 'name' => 'a', 'cpu' => 1, 'memory_mib' => 256, 'state' => 'running',
            'boot' => { 'image' => 'b.qcow2', 'disk_gib' => 2 }, 'guest_interfaces' => [{ 'name' => 'd0' }] }
    new = old.merge('memory_mib' => 512, 'state' => 'stopped', 'guest_interfaces' => [],
                    'boot' => { 'image' => 'b.qcow2', 'disk_gib' => 3 })
    assert_equal %w[boot.disk_gib memory_mib], Spec.drift(old, new)
    assert_equal %w[boot.image], Spec.drift(old, old.merge('boot' => { 'image' => 'c.qcow2', 'disk_gib' => 2 }))
    assert_equal %w[role], Spec.drift(old, old.merge('role' => 'web'))
    assert_empty Spec.drift(old, old.merge('cpu' => '1'))
  end

  KEY = 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA'

  # What the type munges a declared guest_exec to (Puppet never syncs a should of false).
  MUNGED_TRUE = :true # rubocop:disable Lint/BooleanSymbol
  MUNGED_FALSE = :false # rubocop:disable Lint/BooleanSymbol

  def test_guest_exec_is_true_when_the_daemon_leaves_it_out
    assert_equal true, Spec.attribute_value({ 'name' => 'a' }, :guest_exec)
    assert_equal false, Spec.attribute_value({ 'name' => 'a', 'guest_exec' => false }, :guest_exec)
    assert Spec.same?(:guest_exec, true, true)
    assert Spec.same?(:guest_exec, :absent, true)
    refute Spec.same?(:guest_exec, true, false)
    refute Spec.same?(:guest_exec, false, true)
    assert Spec.same?(:guest_exec, false, MUNGED_FALSE)
    refute Spec.same?(:guest_exec, true, MUNGED_FALSE)
    assert Spec.same?(:guest_exec, true, MUNGED_TRUE)
    assert_equal false, Spec.build('a', nil, { guest_exec: MUNGED_FALSE }, nil)['guest_exec']
    assert_equal true, Spec.build('a', nil, { guest_exec: MUNGED_TRUE }, nil)['guest_exec']
  end

  def test_ssh_compares_with_the_daemons_default_user
    assert_equal :absent, Spec.attribute_value({ 'name' => 'a' }, :ssh)
    recorded = { 'user' => 'vmhost', 'keys' => [KEY] }
    assert Spec.same?(:ssh, recorded, { 'keys' => [KEY] })
    assert Spec.same?(:ssh, recorded, { user: 'vmhost', keys: [KEY] })
    refute Spec.same?(:ssh, recorded.merge('user' => 'ops'), { 'keys' => [KEY] })
    refute Spec.same?(:ssh, recorded, { 'keys' => [KEY, "#{KEY} second"] })
    refute Spec.same?(:ssh, :absent, { 'keys' => [KEY] })
    assert Spec.same?(:ssh, :absent, {})
    refute Spec.same?(:ssh, recorded, {})
  end

  def test_ssh_is_not_drift_and_guest_exec_is_named_as_vmhostd_does
    old = { 'name' => 'a', 'cpu' => 1, 'memory_mib' => 256, 'boot' => { 'kernel' => '/k' } }
    assert_empty Spec.drift(old, old.merge('ssh' => { 'user' => 'vmhost', 'keys' => [KEY] }))
    assert_equal %w[guest_exec], Spec.drift(old, old.merge('guest_exec' => false))
    spec = Spec.build('a', old.merge('ssh' => { 'user' => 'ops', 'keys' => [KEY] }), { ssh: {}, guest_exec: false },
                      nil)
    refute spec.key?('ssh')
    assert_equal false, spec['guest_exec']
  end

  def test_performance_members_left_out_by_the_daemon_have_their_default
    spec = { 'name' => 'a' }
    assert_equal 'shared', Spec.attribute_value(spec, :cpu_policy)
    assert_equal false, Spec.attribute_value(spec, :emulator_cpu)
    assert_equal :absent, Spec.attribute_value(spec, :numa)
    assert_equal :absent, Spec.attribute_value(spec, :hugepages)
    assert Spec.same?(:cpu_policy, :absent, 'shared')
    refute Spec.same?(:cpu_policy, :absent, 'dedicated')
    assert Spec.same?(:emulator_cpu, :absent, MUNGED_FALSE)
    refute Spec.same?(:emulator_cpu, false, MUNGED_TRUE)
    assert Spec.same?(:emulator_cpu, true, MUNGED_TRUE)
    assert Spec.same?(:numa, 1, 1)
    refute Spec.same?(:numa, :absent, 'none')
    assert Spec.same?(:numa, :absent, :absent)
    refute Spec.same?(:hugepages, '2M', :absent)
  end

  def test_a_nic_without_queues_has_one_queue_pair
    assert Spec.same?(:nics, [{ 'network' => 'lan' }], [{ 'network' => 'lan', 'queues' => '1' }])
    assert Spec.same?(:nics, [{ 'network' => 'lan', 'queues' => 4 }], [{ 'network' => 'lan', 'queues' => '4' }])
    refute Spec.same?(:nics, [{ 'network' => 'lan' }], [{ 'network' => 'lan', 'queues' => 2 }])
  end

  def test_nic_capture_and_trunk_members_compare_as_vmhostd_echoes_them
    monitor = { 'mode' => 'monitor', 'source' => 'eth1', 'direction' => 'ingress' }
    assert Spec.same?(:nics, [monitor], [monitor.merge('trunk' => false)])
    assert Spec.same?(:nics, [{ 'network' => 'lan' }], [{ 'network' => 'lan', 'mode' => 'bridge', 'vlans' => [] }])
    assert Spec.same?(:nics, [{ 'network' => 'lan', 'vlans' => [10, 20] }],
                      [{ 'network' => 'lan', 'vlans' => %w[10 20] }])
    assert Spec.same?(:nics, [{ 'network' => 'lan', 'trunk' => true }], [{ 'network' => 'lan', 'trunk' => true }])
    refute Spec.same?(:nics, [{ 'network' => 'lan' }], [{ 'network' => 'lan', 'trunk' => true }])
    refute Spec.same?(:nics, [monitor], [monitor.merge('direction' => 'both')])
    refute Spec.same?(:nics, [monitor], [monitor.merge('source' => 'eth2')])
    refute Spec.same?(:nics, [{ 'network' => 'lan', 'vlans' => [10] }], [{ 'network' => 'lan', 'vlans' => [10, 20] }])
  end

  def test_build_sends_vlans_as_numbers_and_the_rest_as_declared
    nics = [{ 'network' => 'lan', 'vlans' => %w[10 20] }, { 'mode' => 'monitor', 'source' => 'bond0' }]
    spec = Spec.build('a', nil, { nics: Spec.normalize(nics, 'nics') }, nil)
    assert_equal [{ 'network' => 'lan', 'vlans' => [10, 20] }, { 'mode' => 'monitor', 'source' => 'bond0' }],
                 spec['nics']
  end

  def test_build_sends_performance_members_as_vmhostd_takes_them
    recorded = { 'name' => 'a', 'cpu' => 2, 'memory_mib' => 2048, 'state' => 'running',
                 'boot' => { 'kernel' => '/k' }, 'hugepages' => '2M', 'numa' => 'auto' }
    spec = Spec.build('a', recorded, { cpu_policy: 'dedicated', numa: '0', emulator_cpu: MUNGED_TRUE,
                                       hugepages: :absent }, nil)
    assert_equal ['dedicated', 0, true], spec.values_at('cpu_policy', 'numa', 'emulator_cpu')
    refute spec.key?('hugepages')
    assert_equal %w[cpu_policy emulator_cpu hugepages numa], Spec.drift(recorded, spec)
    assert_equal false, Spec.build('a', nil, { emulator_cpu: MUNGED_FALSE }, nil)['emulator_cpu']
  end

  def test_attribute_for_field
    assert_equal 'ssh', Spec.attribute_for_field('spec.ssh.keys[0]')
    assert_equal 'guest_exec', Spec.attribute_for_field('spec.guest_exec')
    assert_equal 'cpu_policy', Spec.attribute_for_field('spec.cpu_policy')
    assert_equal 'numa', Spec.attribute_for_field('spec.numa')
    assert_equal 'hugepages', Spec.attribute_for_field('spec.hugepages')
    assert_equal 'emulator_cpu', Spec.attribute_for_field('spec.emulator_cpu')
    assert_equal 'memory', Spec.attribute_for_field('spec.memory_mib')
    assert_equal 'cpu', Spec.attribute_for_field('spec.cpu')
    assert_equal 'nics', Spec.attribute_for_field('spec.nics[0].ipv4.address')
    assert_equal 'hardware', Spec.attribute_for_field('spec.hardware.sfp[1]')
    assert_equal 'guest_interfaces', Spec.attribute_for_field('spec.guest_interfaces[0].vlan_id')
    assert_equal 'name', Spec.attribute_for_field('spec.name')
    assert_equal 'ensure', Spec.attribute_for_field('spec.state')
    assert_nil Spec.attribute_for_field('spec')
    assert_nil Spec.attribute_for_field('name')
    assert_nil Spec.attribute_for_field(nil)
  end
end

# tpm, boot.secure_boot (and firmware bios) and a disk's snapshot: declared at their default
# they compare equal to the daemon's view that leaves them out.
class TestSpecDefaults < Minitest::Test
  Spec = PuppetX::Vmhost::Spec
  MUNGED_TRUE = :true # rubocop:disable Lint/BooleanSymbol
  MUNGED_FALSE = :false # rubocop:disable Lint/BooleanSymbol

  def test_tpm_left_out_by_the_daemon_is_false_and_is_sent_as_a_boolean
    assert_equal false, Spec.attribute_value({ 'name' => 'a' }, :tpm)
    assert_equal true, Spec.attribute_value({ 'name' => 'a', 'tpm' => true }, :tpm)
    assert Spec.same?(:tpm, :absent, MUNGED_FALSE)
    assert Spec.same?(:tpm, false, MUNGED_FALSE)
    refute Spec.same?(:tpm, :absent, MUNGED_TRUE)
    assert Spec.same?(:tpm, true, MUNGED_TRUE)
    assert_equal true, Spec.build('a', { 'name' => 'a' }, { tpm: MUNGED_TRUE }, nil)['tpm']
    assert_equal false, Spec.build('a', { 'name' => 'a', 'tpm' => true }, { tpm: MUNGED_FALSE }, nil)['tpm']
    assert_equal %w[tpm], Spec.drift({ 'name' => 'a' }, { 'name' => 'a', 'tpm' => true })
    assert_equal 'tpm', Spec.attribute_for_field('spec.tpm')
  end

  def test_boot_members_at_their_default_compare_equal_to_the_view_without_them
    view = { 'image' => 'base.qcow2', 'firmware' => 'uefi' }
    assert Spec.same?(:boot, view, view.merge('secure_boot' => false))
    assert Spec.same?(:boot, view, view.merge('secure_boot' => 'false'))
    refute Spec.same?(:boot, view, view.merge('secure_boot' => true))
    assert Spec.same?(:boot, view.merge('secure_boot' => true), view.merge('secure_boot' => true))
    refute Spec.same?(:boot, view.merge('secure_boot' => true), view)
    bios = { 'image' => 'base.qcow2' }
    assert Spec.same?(:boot, bios, bios.merge('firmware' => 'bios', 'secure_boot' => false))
    refute Spec.same?(:boot, bios, view)
  end

  def test_a_disk_in_snapshots_compares_equal_to_the_view_without_snapshot
    disk = { 'name' => 'nsm', 'size_gib' => 5 }
    assert Spec.same?(:disks, [disk], [disk.merge('snapshot' => true, 'size_gib' => '5')])
    refute Spec.same?(:disks, [disk], [disk.merge('snapshot' => false)])
    assert Spec.same?(:disks, [disk.merge('snapshot' => false)], [disk.merge('snapshot' => false)])
    refute Spec.same?(:disks, [disk.merge('snapshot' => false)], [disk])
    refute Spec.same?(:disks, [disk], [disk, { 'name' => 'b', 'size_gib' => 1, 'snapshot' => true }])
  end
end
