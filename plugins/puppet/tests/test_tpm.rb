# frozen_string_literal: true

require_relative 'puppet_run'

require 'puppet/type/vmhost_vm'
require 'puppet/provider/vmhost_vm/vmhostd'
require_relative 'fake_vm_logic'

# `tpm`, `boot.secure_boot` and a data disk's `snapshot` in a real (in-process) catalog run
# against a fake daemon that leaves them out of its views at their default, as vmhostd does.
class TestTpm < Minitest::Test
  include PuppetRun
  include FakeVmLogic

  UEFI = KERNEL_BOOT.merge('firmware' => 'uefi')

  def test_declared_defaults_are_sent_and_a_rerun_changes_nothing
    attrs = web1(tpm: false, boot: UEFI.merge('secure_boot' => false),
                 disks: [{ 'name' => 'data', 'size_gib' => 1, 'snapshot' => true }])
    assert apply_vm(**attrs).changed
    assert_equal [false, false, true], sent_members
    recorded = @vms['web1']['spec']
    assert_equal [false, false, false],
                 [recorded.key?('tpm'), recorded['boot'].key?('secure_boot'), recorded['disks'][0].key?('snapshot')]
    refute apply_vm(**attrs).changed
    assert_equal %w[vm.list], @fake.methods_called
  end

  def test_tpm_secure_boot_and_an_unsnapshotted_disk_are_changes_sent_as_booleans
    apply_vm(**web1(boot: UEFI, disks: [{ 'name' => 'data', 'size_gib' => 1 }]))
    @fake.request_list
    attrs = web1(tpm: true, boot: UEFI.merge('secure_boot' => true),
                 disks: [{ 'name' => 'data', 'size_gib' => 1, 'snapshot' => false }])
    assert apply_vm(**attrs).changed
    assert_equal [true, true, false], sent_members
    assert_includes logs_text, 'reconfigured in place, disk kept (boot.secure_boot, disks, tpm)'
    refute apply_vm(**attrs).changed
    # Back to the defaults: sent explicitly, then in sync with the view without them.
    back = web1(tpm: false, boot: UEFI.merge('secure_boot' => false),
                disks: [{ 'name' => 'data', 'size_gib' => 1, 'snapshot' => true }])
    assert apply_vm(**back).changed
    refute @vms['web1']['spec'].key?('tpm')
    refute apply_vm(**back).changed
  end

  # tpm, boot.secure_boot and the first disk's snapshot in the vm.apply of the last run.
  def sent_members
    spec = @fake.request_list.find { |r| r['method'] == 'vm.apply' }['params']['spec']
    [spec['tpm'], spec['boot']['secure_boot'], spec['disks'][0]['snapshot']]
  end

  def test_tpm_takes_only_booleans
    type = Puppet::Type.type(:vmhost_vm)
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', tpm: 'yes') }
    assert_equal :true, type.new(name: 'x', tpm: true)[:tpm] # rubocop:disable Lint/BooleanSymbol
  end
end
